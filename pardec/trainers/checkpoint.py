"""Atomic, verified, exactly-resumable training checkpoints.

Layout under ``<output_dir>/checkpoints``::

    step-00000040/            DeepSpeed state (model, optimizer, scheduler), rng_rank<r>.pt for every
                              rank, config.yaml (the resolved run config), checksums.json (sha256 and
                              size of every other file) and trainer_state.json (written last)
    latest                    text file naming the newest complete checkpoint

What is guaranteed (docs/guide/resume.md):

* A checkpoint is *complete* when ``trainer_state.json`` exists in a directory named ``step-N``;
  it is written last, after every rank's files and the checksums, and the directory only gets its
  final name by an atomic rename. ``latest`` is replaced atomically (write ``latest.tmp``, rename).
* The save sequence (``_crash_point`` marks each boundary, for the tests)::

      write step-N.tmp (all ranks)  -> checksums, config, state   [written]
      step-N exists: own   -> step-N.old                          [moved_aside]
                     other -> step-N.displaced-<time> (kept)
      step-N.tmp -> step-N                                        [swapped]
      latest := step-N                                            [latest_written]
      delete step-N.old                                           [old_deleted]
      prune

  A kill at any point leaves either the old or the new ``step-N`` (``recover`` restores a
  ``step-N.old`` whose replacement never landed) and ``latest`` naming a complete checkpoint, or a
  ``latest`` that :func:`plan_resume` repairs from the newest complete checkpoint, with a warning.
* Every checkpoint records its run's *lineage* (an id created by a fresh start and kept by every
  resume of it). Pruning (``trainer.keep_checkpoints``) only ever deletes complete checkpoints of
  its own lineage, oldest written first, and never the one ``latest`` names; checkpoints of other
  runs (or from before lineages existed) are never deleted, and one in the way of a save is renamed
  to ``step-N.displaced-<time>``, not deleted. Deletion renames to ``*.deleting`` first, so a kill
  mid-delete never leaves a directory that looks complete.
* Resume verifies the checksums (a same-size corruption is found and the file named); a checkpoint
  written with checksums whose ``checksums.json`` is missing is refused, naming the file.
* ``latest`` must name a ``step-N`` directory directly inside the run's ``checkpoints`` (not a path
  out of it, not a symbolic link); anything else is refused, naming the file and the value.
* A fresh start (``trainer.resume=never``, or ``auto`` with nothing to resume) in a directory that
  holds a previous run's checkpoints, exports or DONE marker refuses, naming them, unless
  ``trainer.on_existing`` is ``archive`` (moved to ``<output_dir>/archive/<time>/``) or ``delete``.

Only rank 0 renames, deletes and repairs; :func:`run_on_main` shares its result (or its error)
with every rank. Concurrent runs in one directory are excluded by :mod:`pardec.trainers.run_lock`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from pardec.common.config_fields import Choice
from pardec.common.distributed import barrier
from pardec.common.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"
CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
ARCHIVE = "archive"
_TAG = re.compile(r"step-(\d{8})")
# What a previous run leaves in an output directory (moved by trainer.on_existing=archive).
RUN_STATE = ("checkpoints", "stages", "hf", "DONE", "PREEMPTED", "metrics.jsonl", "metrics.dropped.jsonl",
             "config.yaml", "deepspeed_config.json")


class OnExisting(Choice):
    """``trainer.on_existing``: what a fresh start does with a previous run (:func:`clear_prior_state`)."""

    refuse = "refuse"
    archive = "archive"
    delete = "delete"


T = TypeVar("T")


def _crash_point(name: str) -> None:
    """No-op in production; tests replace it to kill the save sequence at an exact boundary."""


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


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


def run_on_main(fn: Callable[[], T], is_main: bool, share_result: bool = True) -> T | None:
    """Run ``fn`` on rank 0 only and raise its error on every rank; its result is given to every
    rank (``share_result``) or kept on rank 0 (None elsewhere)."""
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 (re-raised below, on every rank)
            error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [(result if share_result else None, error)]
        dist.broadcast_object_list(box, src=0)
        if share_result or not is_main:
            result = box[0][0]
        error = box[0][1]
    if error is not None:
        raise error
    return result


# ---------------------------------------------------------------------------------------------
# small file-system helpers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    """Delete a directory so that a kill midway never leaves something that looks complete."""
    doomed = path.with_name(path.name + ".deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any] | None:
    """The checkpoint's trainer state, or None if ``path`` is not a complete checkpoint."""
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def _saved_at(path: Path, state: dict[str, Any]) -> float:
    if isinstance(state.get("saved_at"), (int, float)):
        return float(state["saved_at"])
    return (path / STATE_FILE).stat().st_mtime  # checkpoints from before saved_at was recorded


def complete_checkpoints(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Complete ``step-N`` checkpoints under ``root`` with their states, oldest written first."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        if _TAG.fullmatch(path.name) and path.is_dir() and not path.is_symlink():  # a link: not this run's
            state = read_state(path)
            if state is not None:
                found.append((path, state))
    return sorted(found, key=lambda ps: (_saved_at(*ps), ps[1].get("step", 0)))


# ---------------------------------------------------------------------------------------------
# checksums


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of a file (checkpoint files here, training data files in ``fingerprint``)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": path.stat().st_size, "sha256": digest}


def _checkpoint_files(path: Path) -> list[str]:
    skip = {STATE_FILE, CHECKSUM_FILE}
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name not in skip)


def _gather(local: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def compute_checksums(path: Path) -> dict[str, dict[str, Any]]:
    """sha256 of every file of a checkpoint directory, hashed by all ranks in parallel (each a
    share of the files); every rank gets the whole table."""
    rank, world = _rank_world()
    files = _checkpoint_files(path)
    mine = {name: file_digest(path / name) for name in files[rank::world]}
    table: dict[str, dict[str, Any]] = {}
    for part in _gather(mine):
        table.update(part)
    return table


def verify_checksums(path: Path) -> None:
    """Check every file listed in ``checksums.json`` (size and sha256), shared over the ranks.
    Raises CheckpointError naming the first bad file on every rank."""
    manifest_file = path / CHECKSUM_FILE
    if not manifest_file.is_file():
        # saved_at and checksums.json were introduced together: a state with saved_at was saved with checksums.
        if "saved_at" in (read_state(path) or {}):
            raise CheckpointError(
                f"corrupt checkpoint {path}: {manifest_file} is missing, but this checkpoint was written with "
                f"checksums (its {STATE_FILE} records saved_at), so its files cannot be verified; resume from "
                f"another checkpoint with trainer.resume=<dir>")
        log.warning("checkpoint %s has no %s (written before checksums were recorded): not verified",
                    path, CHECKSUM_FILE)
        return
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"corrupt checkpoint file {manifest_file}: {err}") from err
    rank, world = _rank_world()
    problems = []
    for name in sorted(manifest)[rank::world]:
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        got = file_digest(file)
        if got["size"] != manifest[name]["size"]:
            problems.append(f"{file} has {got['size']} bytes, {manifest[name]['size']} were written")
        elif got["sha256"] != manifest[name]["sha256"]:
            problems.append(f"{file} does not match its recorded sha256 (same size, different content)")
    problems = [p for part in _gather(problems) for p in part]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"corrupt checkpoint {path}: {problems[0]}{more}; resume from another "
                              f"checkpoint with trainer.resume=<dir>")


# ---------------------------------------------------------------------------------------------
# saving


def save_training_state(engine, root: Path, step: int, trainer_state: dict[str, Any], rank: int, keep: int,
                    config_yaml: str | None = None) -> Path:
    """Write ``root/step-N`` (see the module docstring for the sequence); ``trainer_state`` carries
    ``lineage``, which decides what pruning may delete."""
    tag = tag_for(step)
    tmp = root / (tag + ".tmp")
    final = root / tag
    lineage = trainer_state.get("lineage")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save of this step: never committed
    barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, client_state={"trainer_state": trainer_state}, save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0 and config_yaml is not None:
        _write_atomic(tmp / CONFIG_FILE, config_yaml)
    barrier()
    checksums = compute_checksums(tmp)
    if rank == 0:
        _write_atomic(tmp / CHECKSUM_FILE, json.dumps(checksums, indent=1, sort_keys=True))
        _write_atomic(tmp / STATE_FILE, json.dumps({**trainer_state, "saved_at": time.time()}, indent=2))
        _crash_point("written")
        old = None
        if final.exists():
            previous = read_state(final)
            if previous is not None and lineage is not None and previous.get("lineage") == lineage:
                old = final.with_name(tag + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            else:
                aside = final.with_name(f"{tag}.displaced-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(final, aside)
                log.warning("%s belongs to another run (or is incomplete); moved to %s, not deleted", final, aside)
            _crash_point("moved_aside")
        os.replace(tmp, final)
        _fsync_dir(root)
        _crash_point("swapped")
        _write_atomic(root / LATEST, tag)
        _crash_point("latest_written")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _crash_point("old_deleted")
        _prune(root, keep, lineage)
    barrier()
    return final


def _prune(root: Path, keep: int, lineage: str | None) -> None:
    """Keep this lineage's ``keep`` most recently written checkpoints; never touch another run's
    checkpoints or the one ``latest`` names."""
    if keep <= 0 or lineage is None:
        return
    own = [p for p, state in complete_checkpoints(root) if state.get("lineage") == lineage]
    protected = read_latest(root)
    for path in own[:-keep]:
        if path.name != protected:
            _remove(path)


# ---------------------------------------------------------------------------------------------
# resuming


def recover(root: Path) -> list[str]:
    """Finish or undo a save/prune that a kill interrupted (rank 0, before anything reads ``root``).
    Returns what was done, for the log."""
    notes = []
    if not root.is_dir():
        return notes
    for old in sorted(root.glob("step-*.old")):
        final = root / old.name[: -len(".old")]
        if read_state(final) is not None:
            shutil.rmtree(old, ignore_errors=True)  # the swap had landed; .old is a superseded copy
        elif read_state(old) is not None:
            if final.exists():
                _remove(final)  # can only be a partial leftover: it has no trainer_state.json
            os.replace(old, final)
            notes.append(f"restored {final} from {old.name} (a save of that step was interrupted)")
    for doomed in root.glob("*.deleting"):
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in root.glob("step-*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return notes


@dataclass
class ResumePlan:
    path: Path | None  # checkpoint to load; None = fresh start
    step: int
    lineage: str
    notes: list[str] = field(default_factory=list)  # repairs and archiving, logged as warnings


def prior_run_state(output_dir: Path) -> list[str]:
    """What a previous run left in ``output_dir`` that a fresh start would mix with or overwrite:
    checkpoint directories, Hugging Face exports, DONE markers (also under ``stages/``)."""
    found = []
    dirs = [output_dir]
    if (output_dir / "stages").is_dir():
        dirs += sorted((output_dir / "stages").glob("*"))
    for d in dirs:
        ckpts = d / CHECKPOINTS
        if ckpts.is_dir():
            found += [str(p.relative_to(output_dir)) for p in sorted(ckpts.glob("step-*")) if p.is_dir()]
        found += [str(p.relative_to(output_dir)) for p in sorted(d.glob("hf*")) if p.is_dir()]
        if (d / "DONE").is_file():
            found.append(str((d / "DONE").relative_to(output_dir)))
    return found


def clear_prior_state(output_dir: Path, on_existing: str, why: str) -> str | None:
    """Refuse a fresh start over a previous run, or archive/delete it as ``trainer.on_existing`` says."""
    found = prior_run_state(output_dir)
    if not found:
        return None
    on_existing = OnExisting(on_existing)
    if on_existing == "refuse":
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise ConfigError(
            f"{output_dir} holds a previous run ({shown}) and {why}, so this run would start from step 0 "
            f"over it. Choose: trainer.resume=auto to continue it; trainer.on_existing=archive to move it "
            f"to {output_dir / ARCHIVE}/<time>/ and start fresh; trainer.on_existing=delete to delete it "
            f"and start fresh; or another output_dir.")
    names = [n for n in RUN_STATE if (output_dir / n).exists()] + sorted(
        p.name for p in output_dir.glob("hf-*") if p.is_dir())
    if on_existing == "delete":
        for name in names:
            path = output_dir / name
            if path.is_dir():
                _remove(path)
            else:
                path.unlink()
        return f"trainer.on_existing=delete: deleted the previous run in {output_dir} ({', '.join(names)})"
    dest = output_dir / ARCHIVE / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "x")
    dest.mkdir(parents=True)
    for name in names:
        os.replace(output_dir / name, dest / name)
    return f"trainer.on_existing=archive: moved the previous run in {output_dir} ({', '.join(names)}) to {dest}"


def _check_own(root: Path, named: str) -> None:
    """``latest`` may only name a checkpoint directory of this run: ``step-N`` directly inside ``root``,
    not a path out of it and not a symbolic link (to another run's checkpoint)."""
    path = root / named
    if not _TAG.fullmatch(named) or path.is_symlink() or (path.exists() and path.resolve().parent != root.resolve()):
        raise CheckpointError(
            f"{root / LATEST} names {named!r}, which is not a checkpoint of this run: it must name a directory "
            f"step-NNNNNNNN directly inside {root} (no path, no symbolic link). Delete {root / LATEST} to resume from "
            f"this run's newest complete checkpoint, or resume another checkpoint explicitly with trainer.resume=<dir>")


def _latest_or_repair(root: Path, notes: list[str]) -> Path | None:
    named = read_latest(root)
    if named is not None:
        _check_own(root, named)
    if named is not None and read_state(root / named) is not None:
        return root / named
    candidates = complete_checkpoints(root)
    if not candidates:
        if named is not None:
            raise CheckpointError(
                f"{root / LATEST} names {named}, but {root / named / STATE_FILE} is missing and {root} holds no "
                f"other complete checkpoint: nothing to resume from. Start over with trainer.resume=never "
                f"trainer.on_existing=archive, or give a checkpoint with trainer.resume=<dir>")
        return None
    newest = candidates[-1][0]
    what = "is missing" if named is None else f"names {named}, which is missing or incomplete"
    _write_atomic(root / LATEST, newest.name)
    notes.append(f"REPAIRED {root / LATEST}: it {what}; it now names {newest.name}, the newest complete checkpoint")
    return newest


def plan_resume(output_dir: Path, resume: str, on_existing: str) -> ResumePlan:
    """Decide (rank 0) where this stage starts: ``trainer.resume`` = ``auto`` (the checkpoint ``latest``
    names, repaired if missing or dangling), ``never`` or a checkpoint directory. A fresh start over a
    previous run goes through :func:`clear_prior_state`."""
    root = output_dir / CHECKPOINTS
    notes = recover(root)
    if resume == "never":
        note = clear_prior_state(output_dir, on_existing, "trainer.resume=never")
        return ResumePlan(None, 0, new_lineage(), notes + ([note] if note else []))
    if resume == "auto":
        path = _latest_or_repair(root, notes)
        if path is None:
            note = clear_prior_state(output_dir, on_existing, f"{root} holds no complete checkpoint to resume from")
            return ResumePlan(None, 0, new_lineage(), notes + ([note] if note else []))
        own = True
    else:
        path = Path(resume)
        if read_state(path) is None:
            raise CheckpointError(f"trainer.resume={resume}: not a checkpoint directory (no {STATE_FILE})")
        own = path.resolve().parent == root.resolve()
        if not own:
            note = clear_prior_state(output_dir, on_existing, f"trainer.resume={resume} is not one of its checkpoints")
            notes += [note] if note else []
    state = read_state(path) or {}
    lineage = state.get("lineage") if own else None
    return ResumePlan(path, int(state.get("step", 0)), lineage or new_lineage(), notes)


def load_training_state(engine, path: Path, rank: int) -> dict[str, Any]:
    """Verify the checksums, restore DeepSpeed state and this rank's RNG; returns the trainer state."""
    try:
        trainer_state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"corrupt checkpoint file {path / STATE_FILE}: {err}") from err
    verify_checksums(path)
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
