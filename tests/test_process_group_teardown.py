"""The CLI entry points destroy the process group they start before the interpreter exits.

A gloo group left to interpreter exit aborts a rank that exits while a peer still runs ("terminate
called without an active exception", SIGABRT): under torchrun rank 1 finishes training first while
rank 0 still writes, and torchrun then stops rank 0 and fails the run. Each check runs in a child
process, so the group the pytest process may hold from in-process training plays no part.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.train_utils import FAST, REPO, child_env


def run_child(script: str, cwd) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_process_group_destroys_only_the_group_it_started_and_not_after_an_error(tmp_path):
    out = run_child("""
        import torch.distributed as dist
        from pardec.common.distributed import process_group

        with process_group(single_process_group=True) as info:
            print("inside", dist.is_initialized(), info.owns_group)
        print("after", dist.is_initialized())

        with process_group(single_process_group=True):
            with process_group(single_process_group=True) as inner:  # joins the running group
                print("inner owns", inner.owns_group)
            print("after inner", dist.is_initialized())

        try:
            with process_group(single_process_group=True):
                raise RuntimeError("a failing rank")
        except RuntimeError:
            print("after error", dist.is_initialized())
    """, tmp_path)
    assert out.split("\n")[:-1] == ["inside True True", "after False", "inner owns False", "after inner True",
                                    "after error True"]


CLIS = {
    "pardec.cli.train": ["trainer.max_steps=1"],
    "pardec.cli.collect_trajectories": ["data.max_train_samples=2", "recipe.block_size=4", "recipe.max_new_tokens=4"],
}


@pytest.mark.parametrize("module", sorted(CLIS))
def test_cli_leaves_no_process_group_at_exit(tmp_path, module):
    args = [*FAST, f"output_dir={tmp_path / 'run'}", *CLIS[module]]
    out = run_child(f"""
        import sys
        import torch.distributed as dist
        import {module} as cli

        sys.argv = ["{module}", *{args!r}]
        cli.main()
        print("group at exit:", dist.is_initialized())
    """, REPO)
    assert out.rstrip().endswith("group at exit: False"), out[-2000:]
