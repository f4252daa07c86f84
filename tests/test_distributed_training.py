"""Two processes under torchrun (gloo, CPU) match one process with the same global batch.

One process with grad_accum=2 sees exactly the global batches that two processes with grad_accum=1
see (pardec/trainers/data_order.py), so the trained weights must agree up to float reduction order. All
runs start from one saved base checkpoint: random initialisation under ZeRO-3's partitioned
``zero.Init`` draws differently from a plain init, and real runs start from pretrained weights.
"""

from __future__ import annotations

import pytest
import torch

from pardec.data_pipelines.jacobi_trajectories import load_trajectories
from tests.train_utils import exported_weights, logged_metrics, run_torchrun, save_tiny_base

STEPS = ["trainer.max_steps=3"]


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base_checkpoint):
    out = tmp_path_factory.mktemp("one")
    run_torchrun([f"output_dir={out}", "model=hf", f"model.path={base_checkpoint}", "trainer.grad_accum=2", *STEPS],
                 nproc=1, cwd=out)
    return exported_weights(out / "hf")


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_processes_match_one(tmp_path, base_checkpoint, one_process, zero):
    run_torchrun([f"output_dir={tmp_path}", "model=hf", f"model.path={base_checkpoint}", f"deepspeed={zero}",
                  "trainer.grad_accum=1", *STEPS], nproc=2, cwd=tmp_path)
    two = exported_weights(tmp_path / "hf")
    base = exported_weights(base_checkpoint)
    assert two.keys() == one_process.keys()
    for name, tensor in two.items():
        assert tensor.numel() > 0, f"{name} exported empty under {zero}"
        assert not torch.equal(tensor, base[name]) or "norm" in name, f"{name} did not train under {zero}"
        torch.testing.assert_close(tensor, one_process[name], rtol=1e-4, atol=1e-5)
    # only rank 0 wrote Hydra's files and metrics
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert len(logged_metrics(tmp_path)) == 3


JACOBI = ["recipe=jacobi_forcing", "recipe.stages=[]", "data.max_train_samples=4", "recipe.block_size=4",
          "recipe.window=2", "recipe.window_phase=random", "recipe.max_new_tokens=8", "recipe.shard_size=1",
          "trainer.micro_batch_size=1", "trainer.max_steps=2"]


def test_jacobi_forcing_collects_in_run_on_two_ranks_like_one(tmp_path, base_checkpoint):
    """In-run trajectory collection sharded over 2 ranks (each collects its shards, then all wait at
    a barrier and read every shard) gives the one-process trajectories, and training on them the
    one-process weights (global batch 2 either way)."""
    runs = {}
    for nproc, accum in ((1, 2), (2, 1)):
        out = tmp_path / f"nproc{nproc}"
        run_torchrun([f"output_dir={out}", "model=hf", f"model.path={base_checkpoint}", *JACOBI,
                      f"trainer.grad_accum={accum}"], nproc=nproc, cwd=tmp_path)
        runs[nproc] = (load_trajectories(out / "trajectories"), exported_weights(out / "hf"))
    (traj1, weights1), (traj2, weights2) = runs[1], runs[2]
    assert len(traj1) == 4 and [dict(r) for r in traj2] == [dict(r) for r in traj1]
    base = exported_weights(base_checkpoint)
    for name, tensor in weights2.items():
        assert not torch.equal(tensor, base[name]) or "norm" in name, f"{name} did not train"
        torch.testing.assert_close(tensor, weights1[name], rtol=1e-4, atol=1e-5)
