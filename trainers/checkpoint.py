"""Atomic, exactly-resumable training checkpoints.

Layout under ``<output_dir>/checkpoints``::

    step-00000040/            DeepSpeed state (model, optimizer, scheduler) + trainer_state.json
                              + rng_rank<r>.pt for every rank
    latest                    text file naming the newest complete checkpoint

A checkpoint is written into ``step-XXXXXXXX.tmp`` by all ranks and renamed by rank 0 only once
every rank has finished; ``latest`` is replaced atomically afterwards. A crash at any point leaves
the previous checkpoint intact and ``latest`` pointing at it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.distributed import barrier
from common.errors import CheckpointError

LATEST = "latest"
STATE_FILE = "trainer_state.json"




def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, root: Path, step: int, trainer_state: dict[str, Any], rank: int, keep: int) -> Path:
    tag = tag_for(step)
    tmp_tag = tag + ".tmp"
    final = root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / tmp_tag, ignore_errors=True)
    barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"trainer_state": trainer_state}, save_latest=False)
    torch.save(rng_state(), root / tmp_tag / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        _write_atomic(root / tmp_tag / STATE_FILE, json.dumps(trainer_state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(root / tmp_tag, final)
        _write_atomic(root / LATEST, tag)
        _prune(root, keep)
    barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    tags = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in tags[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume_dir(output_dir: Path, resume: str) -> Path | None:
    """``auto``: the newest complete checkpoint under output_dir (None if there is none);
    ``never``: None; anything else: that checkpoint directory, which must exist."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"trainer.resume={resume}: not a checkpoint directory (no {STATE_FILE})")
        return path
    root = output_dir / "checkpoints"
    latest = root / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    path = root / tag
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{latest} names {tag}, but {path / STATE_FILE} is missing: the checkpoint is corrupt")
    return path


def load_checkpoint(engine, path: Path, rank: int) -> dict[str, Any]:
    """Restore DeepSpeed state and this rank's RNG; returns the trainer state."""
    try:
        trainer_state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"corrupt checkpoint file {path / STATE_FILE}: {err}") from err
    try:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    except Exception as err:  # torch.load / DeepSpeed raise many types on truncated files
        raise CheckpointError(f"corrupt checkpoint in {path}: {type(err).__name__}: {err}") from err
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {path}: the checkpoint is incomplete or corrupt")
    rng_file = path / f"rng_rank{rank}.pt"
    try:
        set_rng_state(torch.load(rng_file, weights_only=False))
    except Exception as err:
        raise CheckpointError(f"corrupt or missing RNG state {rng_file}: {err}") from err
    return trainer_state
