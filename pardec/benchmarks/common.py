"""Pieces every decoding benchmark shares: the runtime flags, the held-out problems, exact-identity
scoring, and writing a table with the command and the machine that made it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from omegaconf import OmegaConf

from pardec.common.run_records import machine_description, set_entry
from pardec.data_pipelines.config import DataConfig
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.synthetic_gsm import FRESH_SPLIT, generate_split

# Where the benchmarks save their tables by default: relative to the working directory, so a run
# from the repository root updates the repository's current tables (``benchmarks/results/``).
RESULTS = Path("benchmarks/results")
# Beside the tables: which machine wrote each one (keyed by the table's file stem). TPS and wall times
# compare only within one machine; ratios measured within one run stand on any.
MACHINES = "machines.json"


def add_template_arg(p: argparse.ArgumentParser) -> None:
    """``--template``: the prompt format, as ``data.template`` (every benchmark that tokenises prompts)."""
    p.add_argument("--template", default="auto", choices=["auto", "plain", "chat"],
                   help="prompt format (auto: the tokenizer's chat template when it has one)")


def add_runtime_args(p: argparse.ArgumentParser, *, threads: int = 2, cuda_graphs: bool = True) -> None:
    """The flags every decoding benchmark takes alike: ``--template``, ``--device``, ``--dtype``,
    ``--threads`` (CPU threads, default ``threads``) and, where the rows decode with the inference
    decoders (``cuda_graphs``), ``--cuda-graphs``."""
    add_template_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=threads)
    if cuda_graphs:
        p.add_argument("--cuda-graphs", action="store_true",
                       help="every row decodes with cuda_graphs=true (static cache, each forward a CUDA graph)")


def add_bound_args(p: argparse.ArgumentParser, widest: str) -> None:
    """The flags of the TPF · t(1) / t(q) bound printed beside each TPS ratio, ``widest`` naming the
    decoder's widest forward (``"n"``, ``"2N-1"``)."""
    p.add_argument("--no-bound", action="store_true", help=f"skip the TPF · t(1)/t({widest}) bound")
    p.add_argument("--bound-cache", type=int, default=128, help="KV cache length of the bound's forwards")
    p.add_argument("--bound-repeats", type=int, default=30)


def named_keys(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """The comma-separated keys of ``text`` (a benchmark's ``--rows``), in ``known``'s order; a key not in
    ``known`` is a ValueError naming it and the known ones."""
    keys = {k.strip() for k in text.split(",")}
    unknown = sorted(keys - set(known))
    if unknown:
        raise ValueError(f"unknown row key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return tuple(k for k in known if k in keys)


def or_dash(value: Any, spec: str, suffix: str = "") -> str:
    """A table cell: ``value`` formatted by ``spec`` (then ``suffix``), or a dash where there is none."""
    return "—" if value is None else format(value, spec) + suffix


def held_out_rows(num_samples: int):
    """The first ``num_samples`` problems of the embedded default's test split."""
    data_cfg = OmegaConf.structured(DataConfig)
    data_cfg.max_eval_samples = num_samples
    return load_raw_split(data_cfg, "eval")


def identical(records, reference) -> float:
    """Fraction of samples whose output tokens equal the reference's exactly (records sorted by index)."""
    return sum(r["output_ids"] == ref["output_ids"] for r, ref in zip(records, reference, strict=True)) / len(records)


def validation_rows(num_samples: int):
    """The first ``num_samples`` problems of the embedded default's validation split (disjoint from
    train and test): where decoders are tuned, so the test problems stay held out."""
    return _generated_rows("val", num_val=num_samples)


def fresh_rows(split: str, num_samples: int):
    """The first ``num_samples`` problems of a fresh split (``fresh1``, ``fresh2``, ...: disjoint from
    train, test and the 200 val problems; :mod:`pardec.data_pipelines.synthetic_gsm`): problems nobody
    tuned or reported on, to check a table's numbers on new ones."""
    return _generated_rows(split, num_fresh=num_samples)


def _generated_rows(split: str, **counts: int):
    cfg = OmegaConf.structured(DataConfig).synthetic
    for key, value in counts.items():
        setattr(cfg, key, value)
    return datasets.Dataset.from_list(generate_split(cfg, split))


def split_rows(split: str, num_samples: int):
    """The first ``num_samples`` problems of ``split``: ``val`` (tuning), ``test`` (held out, reported)
    or a fresh split ``fresh<k>`` (new problems, to check results on)."""
    if split == "val":
        return validation_rows(num_samples)
    if split == "test":
        return held_out_rows(num_samples)
    if FRESH_SPLIT.fullmatch(split):
        return fresh_rows(split, num_samples)
    raise ValueError(f"split must be 'val', 'test' or 'fresh<k>' (fresh1, fresh2, ...), got {split!r}")


def split_label(split: str) -> str:
    """How a table's header names ``split``: "test split", "validation split" or "fresh split fresh1"."""
    return {"test": "test split", "val": "validation split"}.get(split, f"fresh split {split}")


def add_split_arg(p: argparse.ArgumentParser, default: str = "test", *, val: bool = True) -> None:
    """``--split``: the problems the table reports, ``test`` (the held-out 200), ``val`` (unless ``val``
    is false: a benchmark that tunes on val first reports on another split) or ``fresh1``, ``fresh2``, ...
    (new problems, disjoint from train, test and val)."""
    names = ("test", "val") if val else ("test",)

    def split_name(text: str) -> str:
        if text in names or FRESH_SPLIT.fullmatch(text):
            return text
        raise argparse.ArgumentTypeError(f"{text!r}: expected {', '.join(names)} or fresh<k> (fresh1, fresh2, ...)")

    p.add_argument("--split", type=split_name, default=default, metavar="{" + ",".join(names) + ",fresh<k>}",
                   help="the problems decoded: " + ", ".join(names) + " or fresh<k> (new problems, disjoint from "
                        "train, test and val; fresh1, fresh2, ... are different ones)")


def fastest_lossless(candidates: list[dict], what: str) -> tuple[dict, str]:
    """(the row of ``candidates`` with the highest TPS among those identical to their own AR greedy on
    every problem, the fastest of all when none is; the rule that chose it, in words). ``what`` names
    the candidates in the rule ("greedy rows")."""
    if not candidates:
        raise ValueError(f"no {what} to choose from")
    lossless = [r for r in candidates if r["identical_to_own_ar"] == 1.0]
    best = max(lossless or candidates, key=lambda r: r["tps"])
    rule = (f"the highest TPS among the {what} identical to own AR greedy" if lossless
            else f"none of the {what} is identical to own AR greedy on val: the highest TPS")
    return best, rule


def invoked_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <arguments>``, quoted as a shell would need them: ``argv`` when a caller
    passed its own (``main(argv)``), else this process's."""
    return f"python -m {module} " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def current_machine() -> dict[str, str | None]:
    """The CPU (:func:`pardec.common.run_records.machine_description`), the GPU when CUDA is available,
    and torch's version."""
    return {"cpu": machine_description(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__}


def machine_name(machine: dict[str, str | None]) -> str:
    """``<GPU>, <CPU>, torch <version>``, leaving out what is None; "not recorded" when all are."""
    torch_version = f"torch {machine['torch']}" if machine.get("torch") else None
    return ", ".join(part for part in (machine.get("gpu"), machine.get("cpu"), torch_version) if part) or "not recorded"


def write_results(out: str | Path, command: str, body: str, payload: Any,
                  machine: dict[str, str | None] | None = None) -> None:
    """``<out>.md``: ``Command: <command>``, ``Machine: <GPU>, <CPU>, torch <version>``, then ``body``;
    ``<out>.json``: ``payload``; and the machine with the time under ``<out>``'s stem in the
    ``machines.json`` beside them (which ``pardec.benchmarks.real_summary`` reads). ``machine`` is the
    one that measured the table, this process's (:func:`current_machine`) unless given: a table pooled
    from saved chunks names the chunks' (``pardec.benchmarks.chunks.pooled_machine``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = current_machine() if machine is None else machine
    out.with_suffix(".md").write_text(f"Command: {command}\nMachine: {machine_name(machine)}\n\n{body}\n")
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    set_entry(out.parent / MACHINES, out.stem, {**machine, "written": time.strftime("%Y-%m-%d %H:%M:%S")})
