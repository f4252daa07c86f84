"""The CLI entry points destroy the process group they start before the interpreter exits, and a rank
that fails alone exits without waiting for its peers (the second half of this file).

A gloo group left to interpreter exit aborts a rank that exits while a peer still runs ("terminate
called without an active exception", SIGABRT): under torchrun rank 1 finishes training first while
rank 0 still writes, and torchrun then stops rank 0 and fails the run. Each check runs in a child
process, so the group the pytest process may hold from in-process training plays no part.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import save_checkpoint, tiny_model, write_eval_jsonl
from tests.train_utils import FAST, REPO, TORCHRUN_2, child_env


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


# -- a rank that fails alone ------------------------------------------------------------------------
# Its peers are on their way to a collective it will never join; were it to wait for them in shutdown's
# barrier, the run would hang until gloo's 30-minute timeout (a barrier against a peer's all_gather
# does not fail). It must exit instead, so that torchrun stops the others.

def run_two_ranks(script: str, tmp_path, *args: str, timeout_s: int = 180) -> subprocess.CompletedProcess:
    """``script`` under torchrun with 2 ranks; ranks still running after ``timeout_s`` (a hang) fail the
    test, stopped by torchrun on its SIGTERM (each rank runs in a session of its own, out of reach of a
    signal to torchrun's group)."""
    path = tmp_path / "ranks.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen([*TORCHRUN_2, str(path), *args], cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=120)
        pytest.fail(f"the ranks still ran after {timeout_s} s: one waited for a peer that will not come")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


AT_EXIT = """
    import atexit
    import sys
    import torch.distributed as dist
    from pardec.common.distributed import init_distributed, shutdown_at_exit

    info = init_distributed()
    atexit.register(lambda: print(f"rank {info.rank} group at exit: {dist.is_initialized()}", flush=True))
    shutdown_at_exit(info)  # registered last, so it runs first
    if sys.argv[1] == "fail" and info.rank == 1:
        raise RuntimeError("rank 1 fails alone")
    gathered = [None, None]
    dist.all_gather_object(gathered, info.rank)
"""


def test_shutdown_at_exit_destroys_the_group_and_is_skipped_by_a_rank_that_fails(tmp_path):
    ok = run_two_ranks(AT_EXIT, tmp_path, "ok")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert sorted(groups_at_exit(ok.stdout)) == [("0", "False"), ("1", "False")]
    failed = run_two_ranks(AT_EXIT, tmp_path, "fail")  # before the fix: hung here
    assert failed.returncode != 0 and "rank 1 fails alone" in failed.stderr
    assert root_cause_rank(failed.stderr) == 1
    assert ("1", "True") in groups_at_exit(failed.stdout)


def root_cause_rank(stderr: str) -> int | None:
    """The rank torchrun saw fail first: a rank that failed alone ended the run, before its peers
    failed (on the lost connection) or torchrun stopped them."""
    found = re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:  .*\n)*?  rank +: (\d+)", stderr)
    return int(found.group(1)) if found else None


def groups_at_exit(stdout: str) -> list[tuple[str, str]]:
    """(rank, whether its group was alive) per rank's line; the two ranks' prints may interleave."""
    return re.findall(r"rank (\d) group at exit: (True|False)", stdout)


def test_validate_cli_rank_that_fails_alone_ends_the_run(tmp_path):
    ck = save_checkpoint(tmp_path / "ck")
    data = write_eval_jsonl(tmp_path / "eval.jsonl")
    args = [f"checkpoint={ck}", "data.source=files", f"data.eval_files=[{data}]", f"output_dir={tmp_path / 'out'}",
            "progress=false", "decoder.max_new_tokens=4"]
    proc = run_two_ranks(f"""
        import os
        import sys
        import pardec.cli.validate as cli
        from pardec.common.errors import CheckpointError

        load = cli.load_for_decoding

        def load_on_rank_0(cfg):
            if os.environ["RANK"] == "1":
                raise CheckpointError("rank 1 cannot read the checkpoint")
            return load(cfg)

        cli.load_for_decoding = load_on_rank_0
        sys.argv = ["validate", *{args!r}]
        cli.validate()
    """, tmp_path)
    assert proc.returncode != 0 and "error: rank 1 cannot read the checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert root_cause_rank(proc.stderr) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.slow  # ~60 s: both lm-eval CLI processes index lm-eval's built-in task files first
def test_lm_eval_cli_rank_that_fails_alone_ends_the_run(tmp_path):
    from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig
    from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer
    from pardec.evaluation.synthetic_task import TASK, write_task

    tok = build_synthetic_tokenizer(SyntheticGSMConfig())
    tiny_model(len(tok)).save_pretrained(tmp_path / "ck")
    tok.save_pretrained(tmp_path / "ck")
    write_task(tmp_path / "tasks", SyntheticGSMConfig(num_test=4))
    args = ["--model", "pardec", "--model_args", f"checkpoint={tmp_path / 'ck'},max_new_tokens=4",
            "--include_path", str(tmp_path / "tasks"), "--tasks", TASK, "--output_path", str(tmp_path / "run.json")]
    proc = run_two_ranks(f"""
        import os
        import sys
        import pardec.evaluation.model as model
        from pardec.cli.lm_eval_harness import main
        from pardec.common.errors import CheckpointError

        load = model.load_for_decoding

        def load_on_rank_0(cfg):  # after PardecLM started the group and handed it to shutdown_at_exit
            if os.environ["RANK"] == "1":
                raise CheckpointError("rank 1 cannot read the checkpoint")
            return load(cfg)

        model.load_for_decoding = load_on_rank_0
        sys.argv = ["pardec-lm-eval", *{args!r}]
        main()
    """, tmp_path, timeout_s=300)
    assert proc.returncode != 0 and "rank 1 cannot read the checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert root_cause_rank(proc.stderr) == 1, proc.stderr[-3000:]
    assert not list(tmp_path.glob("run_*.json"))
