# python -m pardec.benchmarks.chunk_intervals benchmarks/results/real/chunks/cpu_risd \
#   benchmarks/results/real/chunks/cpu_idlm benchmarks/results/real/chunks/cpu_jacobi_forcing \
#   benchmarks/results/real/chunks/cpu_refusion benchmarks/results/real/chunks/cpu_mdm_flashdlm \
#   benchmarks/results/real/chunks/cpu_cover benchmarks/results/real/chunks/cpu_mdm_flashdlm_block8 \
#   benchmarks/results/real/chunks/cpu_cover_block8 benchmarks/results/real/chunks/cpu_mdm_lora_2800_baseline \
#   benchmarks/results/real/chunks/cpu_mdm_lora_2800_flashdlm --out benchmarks/results/real/chunk_intervals
"""95% intervals for a chunked table's TPS ratios and accuracy gaps, from its saved chunks alone.

A chunked benchmark (:mod:`pardec.benchmarks.chunks`: ``idlm_isd``, ``jacobi_forcing``, ``refusion``,
``mdm_flashdlm``, ``cover``) decodes every row of its table on each chunk of problems in turn, so each chunk
holds every row's committed tokens, decoding time and answers from the same few minutes of the machine's run.
The chunks are the units resampled: a percentile bootstrap over chunks (``--resamples`` draws of as many chunks as
the table has, with replacement, seeded by ``--seed``; one draw serves every row, so a ratio's two rows
are resampled together) recomputes each statistic from pooled sums, as the table does, and its 2.5th
and 97.5th percentiles are the interval. The statistics, for every row:

* TPS / base AR and TPS / baseline: (sum of committed tokens / sum of decoding time) of the row over
  the same of the reference row. The references are found by their decoder configs in the chunks'
  fingerprint: base AR is the first ``ar`` row (the base's; an I-DLM or Jacobi Forcing table's own AR row comes
  after it); the baseline is LLaDA low-confidence remasking at one token per step without FreeCache
  (``mdm_lowconf`` with neither ``freecache`` nor ``steps_per_block``). A table without a reference
  has "—" there.
* accuracy gap: the row's accuracy minus base AR's on the same problems, in points (paired).

What an interval covers: which problems were drawn, and how the machine's speed moved from chunk to
chunk during the run. What it does not: another run of the same command (another process, another
hour, another machine of the same kind), which shifts the whole interval by however much the machine
treats the rows differently that time (docs/results/real_cpu.md, "How far the chunked tables' ratios
move within their runs", compares runs). Nothing is decoded and no checkpoint is read: the chunks must
only agree with one another (one fingerprint; a chunk of another setting is refused, naming its file).
Writes ``<out>.{md,json}`` (default ``benchmarks/results/chunk_intervals``); the header names the
machine that decoded each table's chunks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pardec.benchmarks.chunks import CHUNK_FILES, Machine, Records, pooled_machine, read_chunk
from pardec.benchmarks.common import RESULTS, invoked_command, machine_name, write_results

REFERENCES = ("base_ar", "baseline")  # the JSON names of the two references


def reference_of(decoder: dict) -> str | None:
    """Which reference (of :data:`REFERENCES`) a row's decoder config makes it, if any."""
    if decoder.get("name") == "ar":
        return "base_ar"
    plain = not decoder.get("freecache") and "steps_per_block" not in decoder
    return "baseline" if decoder.get("name") == "mdm_lowconf" and plain else None


def load_chunks(chunk_dir: str | Path) -> tuple[list[tuple[str, dict]], list[Records], Machine]:
    """``([(row key, decoder config), ...] in table order, each chunk's records in file order, the
    machine of the chunks)``; every chunk must carry the first chunk's fingerprint."""
    paths = sorted(Path(chunk_dir).glob(CHUNK_FILES))
    if not paths:
        raise FileNotFoundError(f"no chunk files ({CHUNK_FILES}) in {chunk_dir}")
    try:
        fingerprint = json.loads(paths[0].read_text())["fingerprint"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"chunk file {paths[0]} is not a chunk (no readable fingerprint: {err!r})") from err
    chunks, machines = [], []
    for path in paths:
        rows, machine = read_chunk(path, fingerprint)
        chunks.append(rows)
        first, end = (int(part) for part in path.stem.split("-"))
        machines.append((first, end, machine))
    return [(key, decoder) for key, decoder in fingerprint["rows"]], chunks, pooled_machine(machines)


def chunk_sums(chunks: list[Records], key: str) -> np.ndarray:
    """``(chunks, 4)``: per chunk, the row's committed tokens, decoding seconds, right answers and problems."""
    return np.array([[sum(r["committed"] for r in recs), sum(r["wall_time_s"] for r in recs),
                      sum(bool(r["correct"]) for r in recs), len(recs)]
                     for recs in (chunk[key] for chunk in chunks)], dtype=float)


def tps(sums: np.ndarray) -> np.ndarray:
    """TPS of pooled chunk sums: ``sums`` ``(..., chunks, 4)`` -> ``(...)``."""
    return sums[..., 0].sum(-1) / sums[..., 1].sum(-1)


def accuracy(sums: np.ndarray) -> np.ndarray:
    return sums[..., 2].sum(-1) / sums[..., 3].sum(-1)


def interval(samples: np.ndarray) -> list[float]:
    """The 2.5th and 97.5th percentiles of a bootstrap's ``samples``."""
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(low), float(high)]


def table_intervals(chunk_dir: str | Path, resamples: int, seed: int) -> dict:
    """Every row's point values and 95% intervals for one chunked table (the JSON of one table)."""
    rows, chunks, machine = load_chunks(chunk_dir)
    sums = {key: chunk_sums(chunks, key) for key, _ in rows}
    draws = np.random.default_rng(seed).integers(0, len(chunks), size=(resamples, len(chunks)))
    refs = {reference_of(decoder): key for key, decoder in reversed(rows) if reference_of(decoder)}  # the first
    out = []
    for key, _ in rows:
        row = {"row": key, "accuracy": float(accuracy(sums[key])), "tps": float(tps(sums[key]))}
        for name in REFERENCES:
            ref = refs.get(name)
            row[f"tps_vs_{name}"] = float(tps(sums[key]) / tps(sums[ref])) if ref else None
            row[f"tps_vs_{name}_interval"] = interval(tps(sums[key][draws]) / tps(sums[ref][draws])) if ref else None
        ar = refs.get("base_ar")
        row["accuracy_gap"] = float(accuracy(sums[key]) - accuracy(sums[ar])) if ar else None
        row["accuracy_gap_interval"] = (interval(accuracy(sums[key][draws]) - accuracy(sums[ar][draws]))
                                        if ar else None)
        out.append(row)
    problems = int(sum(len(chunk[rows[0][0]]) for chunk in chunks))
    return {"chunk_dir": str(chunk_dir), "chunks": len(chunks), "problems": problems, "machine": machine,
            "rows": out}


def span(value: float | None, bounds: list[float] | None, spec: str, scale: float = 1.0) -> str:
    """``value [low, high]`` in ``spec`` (scaled by ``scale``), or "—"."""
    if value is None:
        return "—"
    low, high = (b * scale for b in bounds)
    return f"{value * scale:{spec}} [{low:{spec}}, {high:{spec}}]"


def markdown(tables: list[dict]) -> str:
    header = ("| row | accuracy | gap to base AR, points [95%] | TPS | TPS / base AR [95%] | TPS / baseline [95%] |\n"
              "|---|---|---|---|---|---|")
    parts = []
    for t in tables:
        lines = [f"| {r['row']} | {r['accuracy']:.1%} | "
                 f"{span(r['accuracy_gap'], r['accuracy_gap_interval'], '+.1f', 100)} | {r['tps']:.2f} | "
                 f"{span(r['tps_vs_base_ar'], r['tps_vs_base_ar_interval'], '.2f')} | "
                 f"{span(r['tps_vs_baseline'], r['tps_vs_baseline_interval'], '.2f')} |" for r in t["rows"]]
        parts.append("\n".join([f"### {t['chunk_dir']}\n\n{t['problems']} problems in {t['chunks']} chunks, decoded "
                                f"on {machine_name(t['machine'])}.\n", header, *lines]))
    return "\n\n".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("chunk_dirs", nargs="+", help="chunk directories of chunked benchmark tables")
    p.add_argument("--resamples", type=int, default=10000, help="bootstrap draws")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "chunk_intervals"))
    args = p.parse_args(argv)
    if args.resamples < 100:
        p.error(f"--resamples must be at least 100 for a 95% interval, got {args.resamples}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tables = [table_intervals(d, args.resamples, args.seed) for d in args.chunk_dirs]
    machines = {}
    for t in tables:
        machines.setdefault(machine_name(t["machine"]), []).append(Path(t["chunk_dir"]).name)
    machine = {"cpu": "; ".join(f"{name} ({', '.join(dirs)})" for name, dirs in machines.items()),
               "gpu": None, "torch": None}
    body = (f"Chunk bootstrap, {args.resamples} draws, seed {args.seed}: each interval covers the problems drawn and "
            f"the machine's speed from chunk to chunk within the run, not another run "
            f"(pardec.benchmarks.chunk_intervals).\n\n{markdown(tables)}")
    print(body, flush=True)
    write_results(args.out, invoked_command("pardec.benchmarks.chunk_intervals", argv), body,
                  {"resamples": args.resamples, "seed": args.seed, "tables": tables}, machine=machine)


if __name__ == "__main__":
    main()
