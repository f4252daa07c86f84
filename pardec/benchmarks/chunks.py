"""A long benchmark run in chunks of problems that survives being stopped (``mdm_flashdlm``, ``cover``,
``idlm_isd``, ``jacobi_forcing``, ``refusion``).

On two CPU cores the MDM decoders cost 15-25 s per problem, so one table on the 200 test problems
takes hours. With ``--chunk-dir DIR`` the benchmark decodes its problems ``--chunk-size`` at a
time, every row of the table back to back on each chunk (so each row's time comes from the same
stretch of the machine's life as the others'), and saves each finished chunk's per-row records in
``DIR/<first>-<end>.json``. Run again with the same arguments, it reads the chunks already there
and decodes only the rest; stopping it loses at most the chunk under way. The table is computed
from the records of all chunks (TPS = all committed tokens / all decoding time of the row), so a
table pooled from chunks that ran in different processes is the same computation as one run's.

Each chunk file records what made it (``fingerprint``: the rows' decoder configs, checkpoints,
split, ..., the sha256 of every file of each checkpoint and the torch version); a chunk whose
fingerprint differs from this run's is refused, naming the file, rather than pooled with records of
another setting. Because the checkpoints are named by their content, not by their path, the chunk
files can be kept (``reproduce --real`` writes them under ``benchmarks/results/real/chunks/``, which
is committed) and a later session, on a fresh machine that re-builds the checkpoints, goes on from
them exactly when its re-built checkpoints are the same bytes (training is seeded and, on the same
kind of CPU with the same threads and torch, deterministic); otherwise every chunk is refused.

What a run measures once before its chunks (a validation sweep that chooses the test rows, the latencies
of a TPF · t(1)/t(q) bound) is kept beside them (:func:`kept_in`, :func:`kept_bound`) and read back on
restart. Each chunk numbers its problems from its first (``pardec.inference.evaluate``'s ``first_index``),
so a seeded decoder (sampling, Jacobi's random drafts) draws for each problem what one run would.

A chunk also records the machine that decoded it (``machine``: CPU, GPU, torch; not part of the
fingerprint, so chunks of one setting pool across machines). The table then names the chunks'
machines, not the machine that read them back: one machine when every chunk names the same, else each
machine with the problems it decoded, "not recorded" for chunks written before chunks recorded it
(:func:`pooled_machine`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pardec.benchmarks.common import current_machine, machine_name
from pardec.benchmarks.real_model_speed import forward_latencies
from pardec.common.model_card import CARD, EVAL_DIR
from pardec.inference.evaluate import evaluate
from pardec.trainers.checkpoint import compute_checksums

Records = dict[str, list[dict]]  # row key -> one record per problem (pardec.inference.evaluate's records)
Machine = dict[str, str | None]  # pardec.benchmarks.common.current_machine(): cpu, gpu, torch
# What the error for a chunk of another setting says (read_chunk); pardec.cli.reproduce looks for it in a
# failed step's log to say how to decode anew.
REFUSED = "was made by another setting"
# The chunk files of a chunk directory (``<first>-<end>.json``), not what else a run keeps beside them (kept_in).
CHUNK_FILES = "[0-9]*-[0-9]*.json"
BOUND_FILE = "bound.json"  # beside a table's chunks: the forward latencies t(q) of its TPF · t(1)/t(q) bound


def add_chunk_args(p: argparse.ArgumentParser) -> None:
    """A benchmark's ``--chunk-dir`` and ``--chunk-size`` (:func:`decode_all`)."""
    p.add_argument("--chunk-dir", default=None,
                   help="decode in chunks of problems saved here, resumed when run again (pardec.benchmarks.chunks)")
    p.add_argument("--chunk-size", type=int, default=10, help="problems per chunk (with --chunk-dir)")


def decode_row(model, tok, problems, decoder: dict, template: str, warmed: set[str], key: str,
               first: int = 0, auxiliary: dict | None = None) -> list[dict]:
    """One row of a table on ``problems`` (the first numbered ``first``): its records in index order. A row
    whose ``key`` is not in ``warmed`` first decodes the first two problems untimed (first-call allocations and
    lazy initialisation would otherwise slow it down) and joins it. ``auxiliary``: the decoder's other models
    (``pardec.inference.evaluate``'s, e.g. a guide)."""
    kwargs = {"template": template, "agreement": False, "shard": False, "auxiliary": auxiliary}
    if key not in warmed:
        evaluate(model, tok, problems.select(range(min(2, len(problems)))), decoder, **kwargs)
        warmed.add(key)
    result = evaluate(model, tok, problems, decoder, progress=True, first_index=first, **kwargs)
    return sorted(result.records, key=lambda r: r["index"])


def decode_rows(models: dict, problems, rows: list[tuple[str, str, dict]], template: str, warmed: set[str],
                first: int = 0) -> Records:
    """Every row of ``rows`` (``(label, model key in models, decoder config)``) on ``problems`` (the first numbered
    ``first``), one after the other, each warmed up once (``warmed``, :func:`decode_row`); records by label in
    index order."""
    return {label: decode_row(*models[which], problems, decoder, template, warmed, label, first)
            for label, which, decoder in rows}


def chunk_bounds(num_problems: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` covering ``range(num_problems)`` in order, ``chunk_size`` at a time."""
    if chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {chunk_size}")
    return [(first, min(first + chunk_size, num_problems)) for first in range(0, num_problems, chunk_size)]


def checkpoint_digest(path: str | Path) -> dict[str, str]:
    """The sha256 of every file of a checkpoint directory (a Hugging Face export: weights, config,
    tokenizer) by file name, but what is written into it after the export: its model card and the
    ``eval/`` runs of ``pardec-validate`` (``reproduce --real`` validates the base there before any
    benchmark, and their metrics hold times). What a chunk names the checkpoint it decoded with."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is not a directory")
    return {name: digest["sha256"] for name, digest in compute_checksums(path).items()
            if name != CARD and not name.startswith(f"{EVAL_DIR}/")}


def with_checkpoints(fingerprint: dict[str, Any], checkpoints: Iterable[str | Path]) -> dict[str, Any]:
    """``fingerprint`` with the torch version and, for each of ``checkpoints``, :func:`checkpoint_digest`."""
    return {**fingerprint, "torch": torch.__version__,
            "checkpoint_sha256": {str(c): checkpoint_digest(c) for c in checkpoints}}


def kept_in(chunk_dir: str | Path | None, name: str, fingerprint: dict[str, Any], compute: Callable[[], Any],
            checkpoints: Iterable[str | Path] = ()) -> tuple[Any, str]:
    """``(result, note)`` of something a chunked run computes once before its chunks (the validation sweep
    that chooses the test rows, a latency probe): without a chunk directory ``compute()`` and no note; with
    one, read from ``chunk_dir/name`` when it was saved with the same fingerprint (:func:`with_checkpoints`),
    the note ``read from <file>, made on <machine>`` for the table's header, else ``compute()``d and saved
    there atomically. So a restarted run, or a table read back from its chunks, makes the same choice and
    shows the same numbers without measuring them again; one saved by another setting is refused as a chunk
    is (:func:`read_chunk`)."""
    if chunk_dir is None:
        return compute(), ""
    path, fingerprint = Path(chunk_dir) / name, with_checkpoints(fingerprint, checkpoints)
    if path.exists():
        result, machine = read_chunk(path, fingerprint)
        return result, f"read from {path}, made on {machine_name(machine) if machine else 'not recorded'}"
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_chunk(path, fingerprint, result, current_machine())
    return result, ""


def bound_fingerprint(args, benchmark: str, widths: list[int]) -> dict[str, Any]:
    """What ``benchmark``'s bound latencies are measured with: the base (``args.base``), the widths, the flags of
    ``pardec.benchmarks.common.add_bound_args`` and the runtime."""
    return {"benchmark": f"{benchmark} bound", "base": args.base, "widths": widths, "bound_cache": args.bound_cache,
            "bound_repeats": args.bound_repeats, "device": args.device, "dtype": args.dtype, "threads": args.threads}


def kept_bound(args, benchmark: str, model, widths: list[int]) -> tuple[dict[int, float], str]:
    """``({width: seconds}, note)``: :func:`pardec.benchmarks.real_model_speed.forward_latencies` of ``model`` (the
    base, ``args.base``) at ``widths``, measured once per chunk directory and kept there as ``BOUND_FILE``
    (:func:`kept_in`), so that a table read back from its chunks keeps its bound; ``({}, "")`` with ``--no-bound``."""
    if args.no_bound:
        return {}, ""
    kept, note = kept_in(args.chunk_dir, BOUND_FILE, bound_fingerprint(args, benchmark, widths),
                         lambda: forward_latencies(model, widths, args.bound_cache, args.bound_repeats), [args.base])
    return {int(width): seconds for width, seconds in kept.items()}, note  # JSON keys are strings once read back


def run_in_chunks(problems, chunk_size: int, chunk_dir: str | Path, fingerprint: dict[str, Any],
                  run_chunk: Callable[[Any, int], Records],
                  on_chunk: Callable[[Records, int, Machine], None] | None = None,
                  checkpoints: Iterable[str | Path] = ()) -> Records:
    """Every row's records over ``problems`` (a ``datasets.Dataset``), decoded by ``run_chunk(subset, first)``
    one chunk at a time, chunks found in ``chunk_dir`` read instead of decoded. ``first`` is the subset's
    first problem number, for ``pardec.inference.evaluate``'s ``first_index``: each record keeps its problem's
    ``index`` and a seeded decoder its problem's seed, as in one run over all problems. ``on_chunk(records so
    far, problems done, machine)`` runs after each chunk (decoded or read), e.g. to write the table so far,
    ``machine`` being :func:`pooled_machine` of the chunks so far. The fingerprint gains the torch version and the
    ``checkpoints``' digests (:func:`with_checkpoints`)."""
    fingerprint = with_checkpoints(fingerprint, checkpoints)
    chunk_dir = Path(chunk_dir)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    pooled: Records = {}
    machines: list[tuple[int, int, Machine | None]] = []
    for first, end in chunk_bounds(len(problems), chunk_size):
        path = chunk_dir / f"{first:04d}-{end:04d}.json"
        if path.exists():
            rows, machine = read_chunk(path, fingerprint)
        else:
            rows, machine = run_chunk(problems.select(range(first, end)), first), current_machine()
            write_chunk(path, fingerprint, rows, machine)
        for key, records in rows.items():
            pooled.setdefault(key, []).extend(records)
        machines.append((first, end, machine))
        if on_chunk is not None:
            on_chunk(pooled, end, pooled_machine(machines))
    return pooled


def pooled_machine(machines: list[tuple[int, int, Machine | None]]) -> Machine:
    """The machine of a table pooled from chunks, given each chunk's ``(first, end, machine or None)``:
    that machine when every chunk recorded the same one; otherwise ``cpu`` names each machine
    (:func:`pardec.benchmarks.common.machine_name`) with the problems it decoded, e.g. ``not recorded
    (problems 0-60); AMD EPYC, 2 cores, torch 2.13.0 (problems 60-200)``, and ``gpu`` and ``torch``
    are None (named in ``cpu`` already). All three are None when no chunk recorded its machine."""
    recorded = [machine for _, _, machine in machines]
    if recorded and all(m == recorded[0] for m in recorded):
        return recorded[0] or {"cpu": None, "gpu": None, "torch": None}  # all recorded alike, or none recorded
    spans: list[list] = []  # [name, first, end], neighbouring chunks of one machine merged
    for first, end, machine in machines:
        name = machine_name(machine) if machine else "not recorded"
        if spans and spans[-1][0] == name and spans[-1][2] == first:
            spans[-1][2] = end
        else:
            spans.append([name, first, end])
    return {"cpu": "; ".join(f"{name} (problems {first}-{end})" for name, first, end in spans),
            "gpu": None, "torch": None}


def decode_all(problems, chunk_dir: str | Path | None, chunk_size: int, fingerprint: dict[str, Any],
               run_chunk: Callable[[Any, int], Records], write_table: Callable[[Records, int, Machine], None],
               checkpoints: Iterable[str | Path] = ()) -> None:
    """A benchmark's decoding: every problem in one go when ``chunk_dir`` is None, else in chunks
    (:func:`run_in_chunks`, the chunks naming ``checkpoints`` by content); ``write_table(records,
    problems done, machine that decoded them)`` after each."""
    if chunk_dir is None:
        write_table(run_chunk(problems, 0), len(problems), current_machine())
    else:
        run_in_chunks(problems, chunk_size, chunk_dir, fingerprint, run_chunk, on_chunk=write_table,
                      checkpoints=checkpoints)


def progress_note(chunk_dir: str | Path | None, chunk_size: int, done: int, total: int) -> str:
    """What a table's header says of its chunks and, while some are missing, how far the run got."""
    note = f" (chunks of {chunk_size}, every row on each chunk in turn, in {chunk_dir})" if chunk_dir else ""
    if done < total:
        note += f"; **{done} of {total} problems done**: run the same command again to go on"
    return note


def read_chunk(path: Path, fingerprint: dict[str, Any]) -> tuple[Records, Machine | None]:
    """A chunk's records and the machine that decoded them (None in chunks from before they recorded it)."""
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"chunk file {path} is not valid JSON ({err}); delete it to decode that chunk again") from err
    current = json.loads(json.dumps(fingerprint))  # as saved: tuples read back as lists
    if saved.get("fingerprint") != current:
        differences = fingerprint_differences(saved.get("fingerprint") or {}, current)
        raise ValueError(f"chunk file {path} {REFUSED} ({differences}): use another "
                         f"--chunk-dir, or delete the chunks to start over")
    return saved["rows"], saved.get("machine")


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """What differs between a chunk's fingerprint and this run's, e.g. ``threads: 1 -> 2`` or
    ``checkpoint runs/x/hf: model.safetensors differs``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if key == "checkpoint_sha256" and isinstance(old, dict) and isinstance(new, dict):
            for ckpt in sorted(set(old) | set(new)):
                a, b = old.get(ckpt) or {}, new.get(ckpt) or {}
                files = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
                if files:
                    out.append(f"checkpoint {ckpt}: {', '.join(files)} differ{'s' if len(files) == 1 else ''}")
        else:
            out.append(f"{key}: {old} -> {new}")
    return "; ".join(out)


def write_chunk(path: Path, fingerprint: dict[str, Any], rows: Records, machine: Machine) -> None:
    """Atomically: a stopped run leaves the chunk whole or absent, never half-written."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "machine": machine, "rows": rows}))
    os.replace(tmp, path)
