"""Compose training configs with Hydra's compose API and run them in-process or under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from pardec.trainers.config import register_schema, validate_train_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "pardec" / "recipes"

# Small and fast: 64 generated problems, short packed rows, no wandb, no progress bar.
FAST = [
    "logging=none",
    "logging.progress_bar=false",
    "data.synthetic.num_train=64",
    "data.pack_length=256",
    "trainer.micro_batch_size=2",
    "trainer.log_every=1",
    "trainer.lr=1e-3",
    "eval.at_end=false",
]


def compose_train(overrides: list[str], validate: bool = True):
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    return validate_train_config(cfg, overrides) if validate else cfg


def run_in_process(overrides: list[str]):
    from pardec.trainers.trainer import run_recipe

    return run_recipe(compose_train(FAST + overrides))


# In-process training in a pytest process sets these (init_distributed, whose process group stays up);
# a child process that inherited them would try to bind the same MASTER_PORT.
DIST_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child pardec process: without :data:`DIST_VARS`, one thread,
    the checkout on ``PYTHONPATH``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def torchrun(nproc: int) -> list[str]:
    """torchrun with ``nproc`` ranks on a free port (--standalone), for a module (``-m``) or a script after it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


TORCHRUN_2 = torchrun(2)


def run_torchrun(overrides: list[str], nproc: int, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [*torchrun(nproc), "-m", "pardec.cli.train", *FAST, *overrides]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def exported_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(export_dir / "model.safetensors"))


def logged_metrics(run_dir: Path) -> list[dict]:
    """The run's (or stage's) metrics.jsonl, one dict per logged step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def save_tiny_base(out: Path) -> Path:
    """The default training config's tiny model (seed 0) and tokenizer saved as a local checkpoint:
    the shared starting point of the multi-process tests."""
    from pardec.models.loading import load_model, load_tokenizer

    cfg = compose_train([])
    torch.manual_seed(0)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    load_model(cfg.model, tokenizer, torch.float32, "sdpa").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
