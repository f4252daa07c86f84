"""Two processes under torchrun (gloo, CPU) match one process with the same global batch.

One process with grad_accum=2 sees exactly the global batches that two processes with grad_accum=1
see (trainers/data_order.py), so the trained weights must agree up to float reduction order.
"""

from __future__ import annotations

import pytest
import torch

from tests.train_utils import exported_weights, run_torchrun

STEPS = ["trainer.max_steps=3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_torchrun([f"output_dir={out}", "trainer.grad_accum=2", *STEPS], nproc=1, cwd=out)
    return exported_weights(out / "hf")


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_processes_match_one(tmp_path, one_process, zero):
    run_torchrun([f"output_dir={tmp_path}", f"deepspeed={zero}", "trainer.grad_accum=1", *STEPS], nproc=2, cwd=tmp_path)
    two = exported_weights(tmp_path / "hf")
    assert two.keys() == one_process.keys()
    for name, tensor in two.items():
        assert tensor.numel() > 0, f"{name} exported empty under {zero}"
        torch.testing.assert_close(tensor, one_process[name], rtol=1e-4, atol=1e-5, msg=f"{zero}: {name}")
    # only rank 0 wrote Hydra's files and metrics
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
