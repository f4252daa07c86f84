"""Fingerprints of what a stage trains on, recorded in every checkpoint and compared on resume.

``trainer_state.json`` of every checkpoint records under ``fingerprint``:

* ``data``: the training split as the model sees it, after tokenisation and the length policy: its
  rows, tokens and the sha256 of every row's ``input_ids`` and ``prompt_len`` in order (whatever the
  source: files, the embedded generator or the hub); with ``data.source=files`` also every file's
  path, size and sha256, so that a replaced file is named;
* ``tokenizer``: its size and the sha256 of its serialised vocabulary and model (added tokens and
  normaliser included), special tokens and chat template, taken as loaded (before a recipe adds
  ``<|mask|>``).

The config check on resume (``pardec.trainers.config.check_resume_config``) compares settings; this
compares the content behind them: a data file replaced under the same name, a tokenizer directory
rewritten. :func:`check_fingerprint` refuses a resume whose fingerprint differs, naming what
changed, unless ``trainer.allow_data_change=true``, which logs the change and continues (later
checkpoints record the new fingerprint). A checkpoint written before fingerprints were recorded is
not compared; a warning says so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from pardec.common.errors import DataError
from pardec.trainers.checkpoint import file_digest

KEY = "fingerprint"
_BATCH = 4096  # rows hashed at a time (the digest depends on it: fixed)


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """``{"size", "sha256"}`` of a tokenizer's content (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    content = json.dumps([model, tokenizer.special_tokens_map, tokenizer.chat_template], sort_keys=True, default=str)
    return {"size": len(tokenizer), "sha256": hashlib.sha256(content.encode()).hexdigest()}


def tokenized_fingerprint(tokenized: datasets.Dataset) -> dict[str, Any]:
    """``{"rows", "tokens", "sha256"}`` of a tokenized split (``input_ids`` and ``prompt_len`` per row)."""
    digest = hashlib.sha256()
    tokens = 0
    for batch in tokenized.with_format("arrow").iter(batch_size=_BATCH):
        ids = batch["input_ids"].combine_chunks()  # a pyarrow Table per batch
        lengths = pc.list_value_length(ids).cast(pa.int64()).to_numpy(zero_copy_only=False)
        digest.update(lengths.tobytes())
        digest.update(ids.flatten().cast(pa.int64()).to_numpy(zero_copy_only=False).tobytes())
        digest.update(batch["prompt_len"].cast(pa.int64()).to_numpy().tobytes())
        tokens += int(lengths.sum())
    return {"rows": len(tokenized), "tokens": tokens, "sha256": digest.hexdigest()}


def run_fingerprint(data_cfg, tokenized: datasets.Dataset, tokenizer: dict[str, Any]) -> dict[str, Any]:
    """The record a checkpoint stores; ``tokenizer`` = :func:`tokenizer_fingerprint` of the tokenizer as loaded."""
    data: dict[str, Any] = {"tokenized": tokenized_fingerprint(tokenized)}
    if data_cfg.source == "files":
        data["files"] = {str(f): file_digest(Path(f)) for f in data_cfg.train_files}
    return {"data": data, "tokenizer": tokenizer}


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two :func:`run_fingerprint` records, one phrase each."""
    changes = []
    old_files, new_files = saved["data"].get("files", {}), current["data"].get("files", {})
    for name in sorted(set(old_files) | set(new_files)):
        old, new = old_files.get(name), new_files.get(name)
        if old is None or new is None:
            changes.append(f"data file {name} {'is new' if old is None else 'is no longer used'}")
        elif old != new:
            changes.append(f"data file {name} changed ({old['size']} -> {new['size']} bytes, sha256 "
                           f"{old['sha256'][:12]} -> {new['sha256'][:12]})")
    old, new = saved["data"]["tokenized"], current["data"]["tokenized"]
    if old != new:
        changes.append(f"the tokenized training set changed ({old['rows']} -> {new['rows']} rows, {old['tokens']} -> "
                       f"{new['tokens']} tokens, sha256 {old['sha256'][:12]} -> {new['sha256'][:12]})")
    old, new = saved["tokenizer"], current["tokenizer"]
    if old != new:
        changes.append(f"the tokenizer changed ({old['size']} -> {new['size']} tokens, sha256 {old['sha256'][:12]} -> "
                       f"{new['sha256'][:12]})")
    return changes


def check_fingerprint(state: dict[str, Any], current: dict[str, Any], allow_change: bool, where: str) -> list[str]:
    """Compare the fingerprint a checkpoint's ``state`` records with ``current``: :class:`DataError`
    naming the changes, or (``allow_change``, or nothing recorded) the notes to log."""
    saved = state.get(KEY)
    if saved is None:
        return [f"{where} records no fingerprint of its training data and tokenizer (written before they were "
                f"recorded): not compared"]
    changes = fingerprint_changes(saved, current)
    if not changes:
        return []
    if not allow_change:
        raise DataError(
            f"resuming {where}: what it was trained on changed: " + "; ".join(changes) + ". Restore the data and "
            "tokenizer it was trained with, set trainer.allow_data_change=true to continue on the new ones (the "
            "change is logged), or start a new run (another output_dir, or trainer.resume=never with "
            "trainer.on_existing=archive)")
    return [f"trainer.allow_data_change=true: resuming {where} on changed data: " + "; ".join(changes)]
