# python -m pardec.benchmarks.summary        (the last step of: bash scripts/reproduce.sh)
"""Every conversion method on one base, side by side: one row per (checkpoint, decoder).

Nothing is measured here: the rows are read from the JSON that each method's benchmark wrote
(``benchmarks/results/<benchmark>.json``), so the table shows exactly what those benchmarks printed,
and the conversion wall times from ``cpu_conversions.json`` beside them (written by the reproduce driver).

Columns:
- accuracy: exact ``#### n`` on the benchmark's held-out test problems (200 by default);
- = base AR: share of samples whose output tokens equal the base's AR greedy output, as measured by
  the benchmark ("—" where it did not decode the base, e.g. COVER);
- TPF: tokens per forward as the benchmark defines it (docs/methods/conventions.md#counting);
- TPS / base AR: TPS over the base's AR greedy measured in the same benchmark run ("—" where that
  run has no base AR row); ratios from different benchmarks come from different runs;
- lossless: the decoder guarantees the output of an AR greedy decode (of the base, or of its own
  checkpoint) and the benchmark measured 100% identity with it; a decoder that claims it and was
  measured below 100% is shown as such and not marked in the plot;
- conversion wall time: wall time of the conversion's training command (all its stages, start-up,
  export and end-of-training evaluation included) in the reproduce run; for the base, the time to
  train it from scratch.

Writes ``summary.md``, ``summary.json`` and ``summary.png`` (accuracy against TPF, lossless decoders
marked; needs matplotlib: ``pip install -e ".[plot]"``) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

from pardec.benchmarks.common import RESULTS, or_dash


@dataclasses.dataclass(frozen=True)
class Source:
    """One benchmark's results file and how to read its test rows by decoder label."""

    name: str
    command: str  # what writes it (the reproduce step)
    rows: Callable[[object], list[dict]]  # the JSON -> rows with a "decoder" label
    identical_to_base: str | None  # key of identity with the base's AR greedy
    identical_to_own: str | None  # key of identity with the checkpoint's own AR greedy
    tps_ratio: str | None  # key of TPS / base AR of the same run


SOURCES = {
    s.name: s
    for s in (
        # A table, or {validation, test, chosen_stride} when N was chosen on val (--num-val).
        Source("idlm_isd", "python -m pardec.benchmarks.idlm_isd", lambda d: d["test"] if isinstance(d, dict) else d,
               "identical_to_base", "identical_to_own_ar", "tps_ratio"),
        Source("jacobi_forcing", "python -m pardec.benchmarks.jacobi_forcing", lambda d: d["decoding"],
               "identical_to_base", "identical_to_own_ar", "tps_ratio"),
        Source("refusion", "python -m pardec.benchmarks.refusion", lambda d: d["test"],
               "identical_to_base", "identical_to_own_ar", "tps_ratio"),
        Source("mdm_flashdlm", "python -m pardec.benchmarks.mdm_flashdlm", lambda d: d,
               "identical_to_base_ar", None, "tps_vs_base_ar"),
        Source("cover", "python -m pardec.benchmarks.cover", lambda d: d["test"], "identical_to_base_ar", None,
               "tps_vs_base_ar"),
    )
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A summary row: ``decoder`` is the benchmark's label (a callable picks it from the JSON, e.g.
    the threshold the benchmark chose on validation); ``lossless`` names the AR greedy the decoder
    reproduces by construction ("base" or "own"), None when it makes no such claim."""

    method: str
    checkpoint: str
    source: str
    decoder: str | Callable[[object], str]
    short: str  # label in the plot
    conversion: str  # reproduce step that trained the checkpoint
    lossless: str | None = None


def refusion_chosen(data) -> str:
    """The ReFusion row at the (b, tau) the benchmark chose on validation."""
    return data["chosen_label"]


def refusion_lossless(data) -> str | None:
    """"own" where the chosen setting reproduces the checkpoint's own AR greedy by construction: the AR
    head's first token and tau >= 0.5 (``pardec.inference.decoders.refusion``); None otherwise."""
    return "own" if data["chosen_first_token"] == "ar" and data["chosen_threshold"] >= 0.5 else None


def cover_chosen(data) -> str:
    """The COVER row at the tau_draft the benchmark chose on validation (not its ablations)."""
    return next(r["decoder"] for r in data["test"] if re.fullmatch(r"COVER tau=[0-9.]+", r["decoder"]))


ROWS: tuple[Row, ...] = (
    Row("AR", "base", "idlm_isd", "AR greedy (base)", "AR greedy", "default_base", "base"),
    Row("I-DLM", "I-DLM (stride 4)", "idlm_isd", "ISD N=2 greedy", "ISD N=2", "idlm_default", "own"),
    Row("I-DLM", "I-DLM (stride 4)", "idlm_isd", "ISD N=3 greedy", "ISD N=3", "idlm_default", "own"),
    Row("I-DLM", "I-DLM (stride 4)", "idlm_isd", "ISD N=4 greedy", "ISD N=4", "idlm_default", "own"),
    Row("I-DLM", "I-DLM (stride 4)", "idlm_isd", "ISD N=4 sample T=1.0", "ISD N=4 T=1", "idlm_default"),
    Row("R-ISD", "gated LoRA on the base", "idlm_isd", "R-ISD N=3 greedy (gated LoRA)", "R-ISD N=3",
        "idlm_lora_default", "base"),
    Row("Jacobi Forcing", "round 2", "jacobi_forcing", "Jacobi n=16 (round 2)", "Jacobi n=16",
        "jacobi_forcing_default", "own"),
    Row("Jacobi Forcing", "round 2", "jacobi_forcing",
        "Multi-block + recycling n=16 K=2 r=0.85 pool=4 verify=4 (round 2)", "MR n=16", "jacobi_forcing_default",
        "own"),
    Row("Jacobi Forcing", "round 2", "jacobi_forcing", "Jacobi n=32 (round 2, trained at n=16)", "Jacobi n=32",
        "jacobi_forcing_default", "own"),
    Row("Jacobi Forcing", "round 2", "jacobi_forcing",
        "Multi-block + recycling n=32 K=2 r=0.85 pool=4 verify=4 (round 2)", "MR n=32", "jacobi_forcing_default",
        "own"),
    Row("ReFusion", "ReFusion", "refusion", refusion_chosen, "ReFusion", "refusion_default"),
    Row("MDM", "MDM", "mdm_flashdlm", "MDM low-confidence, 1 token/step (baseline)", "LLaDA 1/step", "mdm_default"),
    Row("MDM", "MDM", "mdm_flashdlm", "MDM Fast-dLLM threshold tau=0.9 (prefix cache)", "Fast-dLLM", "mdm_default"),
    Row("MDM", "MDM", "mdm_flashdlm", "FreeCache (refresh), low-confidence 1/step", "FreeCache", "mdm_default"),
    Row("MDM", "MDM", "mdm_flashdlm", "FreeCache + guided (assisted, strict)", "FreeCache+guided", "mdm_default"),
    Row("MDM", "MDM + base as guide", "mdm_flashdlm", "Guided (shifted, strict; = base AR greedy)", "guided (shifted)",
        "mdm_default", "base"),
    Row("MDM", "MDM", "cover", "WINO 0.6 / 0.9", "WINO", "mdm_default"),
    Row("MDM", "MDM", "cover", "Saber n=2 / mu=8", "Saber", "mdm_default"),
    Row("MDM", "MDM", "cover", cover_chosen, "COVER", "mdm_default"),
)


def load_sources(results_dir: Path) -> dict[str, object]:
    data = {}
    for name, source in SOURCES.items():
        path = results_dir / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"{path} does not exist: run `{source.command}` first (or bash scripts/reproduce.sh)")
        data[name] = json.loads(path.read_text())
    return data


def conversion_seconds(results_dir: Path) -> dict[str, float]:
    """Wall seconds of each conversion the reproduce driver finished, from ``cpu_conversions.json`` in
    ``results_dir`` (keyed by experiment; {} when it has not run there)."""
    path = results_dir / "cpu_conversions.json"
    if not path.is_file():
        return {}
    return {name: entry["wall_seconds"] for name, entry in json.loads(path.read_text()).items()}


def lossless_status(row: Row, base_identity: float | None, own_identity: float | None) -> tuple[bool, str]:
    """(verified, text): a claim is verified only by a measured 100% identity with its reference."""
    if row.lossless is None:
        return False, "no"
    measured = base_identity if row.lossless == "base" else own_identity
    reference = "base AR" if row.lossless == "base" else "own AR"
    if measured is None:
        return False, f"claimed (= {reference}), not measured"
    if measured == 1.0:
        return True, f"yes (= {reference})"
    return False, f"claimed (= {reference}) but {measured:.1%} identical"


def build(data: dict[str, object], seconds: dict[str, float]) -> list[dict]:
    table = []
    for row in ROWS:
        source = SOURCES[row.source]
        label = row.decoder(data[row.source]) if callable(row.decoder) else row.decoder
        by_label = {r["decoder"]: r for r in source.rows(data[row.source])}
        if label not in by_label:
            raise SystemExit(f"benchmarks/results/{row.source}.json has no row {label!r} (rows: {sorted(by_label)}); "
                             f"re-run `{source.command}`")
        result = by_label[label]
        base_identity = result.get(source.identical_to_base) if source.identical_to_base else None
        own_identity = result.get(source.identical_to_own) if source.identical_to_own else None
        verified, lossless = lossless_status(row, base_identity, own_identity)
        table.append({
            "method": row.method, "checkpoint": row.checkpoint, "decoder": label, "source": row.source,
            "accuracy": result["accuracy"], "identical_to_base": base_identity, "tpf": result["tpf"],
            "tps_ratio": result.get(source.tps_ratio) if source.tps_ratio else None,
            "lossless": lossless, "lossless_verified": verified,
            "conversion": row.conversion, "conversion_seconds": seconds.get(row.conversion), "short": row.short,
        })
    return table


def minutes(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f} min"


def markdown(table: list[dict]) -> str:
    lines = ["| method | checkpoint | decoder | accuracy | = base AR | TPF | TPS / base AR | lossless | "
             "conversion wall time |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        wall = minutes(r["conversion_seconds"]) + (" (the base itself)" if r["conversion"] == "default_base" else "")
        lines.append(f"| {r['method']} | {r['checkpoint']} | {r['decoder']} | {r['accuracy']:.1%} | "
                     f"{or_dash(r['identical_to_base'], '.1%')} | {r['tpf']:.2f} | "
                     f"{or_dash(r['tps_ratio'], '.2f', 'x')} | "
                     f"{r['lossless']} | {wall} |")
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    """Accuracy against TPF, one colour per method; verified-lossless decoders drawn as stars. Two
    panels when the accuracies fall in two clusters far apart (the upper one zoomed), else one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pardec.benchmarks.plot_labels import label_points

    methods = list(dict.fromkeys(r["method"] for r in table))
    colours = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(methods)}
    accuracies = sorted(100 * r["accuracy"] for r in table)
    gaps = [(b - a, a, b) for a, b in zip(accuracies, accuracies[1:])]
    widest = max(gaps, default=(0.0, 0.0, 0.0))
    if widest[0] >= 30:  # two clusters: zoom each
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 2], dpi=120)
        ranges = [(top, widest[2], accuracies[-1]), (bottom, accuracies[0], widest[1])]
    else:
        fig, top = plt.subplots(figsize=(11, 6), dpi=120)
        bottom = top
        ranges = [(top, accuracies[0], accuracies[-1])]
    labels = []  # (axes, [(x, y, text)]) placed once the layout is final
    for ax, low, high in ranges:
        margin = max(1.0, 0.1 * (high - low))
        ax.set_ylim(low - margin, high + margin)
        ax.grid(alpha=0.3)
        shown = sorted((r for r in table if low <= 100 * r["accuracy"] <= high), key=lambda r: r["tpf"])
        for r in shown:
            star = r["lossless_verified"]
            ax.scatter(r["tpf"], 100 * r["accuracy"], color=colours[r["method"]], marker="*" if star else "o",
                       s=180 if star else 60, edgecolors="black", linewidths=0.5, zorder=3)
        labels.append((ax, [(r["tpf"], 100 * r["accuracy"], r["short"]) for r in shown]))
    for m in methods:
        top.scatter([], [], color=colours[m], marker="o", label=m)
    top.scatter([], [], color="white", edgecolors="black", marker="*", s=180, label="lossless (verified)")
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.set_xlabel("tokens per forward (TPF)")
    fig.supylabel("accuracy on the held-out test problems (%)")
    top.set_title("Every conversion of the embedded default base (benchmarks/results/summary.md)")
    fig.tight_layout()
    for ax, points in labels:  # after the layout: the labels are placed in pixels
        label_points(ax, points)
    fig.savefig(path, dpi=fig.dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="where the benchmarks wrote their JSON")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    table = build(load_sources(args.results_dir), conversion_seconds(args.results_dir))
    md = markdown(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.md").write_text(
        "Command: python -m pardec.benchmarks.summary (reads the benchmarks' JSON and cpu_conversions.json in "
        "this folder; see the module docstring for the columns)\n\n" + md + "\n")
    (args.out_dir / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    plot(table, args.out_dir / "summary.png")
    print(md)
    print(f"\nwrote {args.out_dir / 'summary.md'}, summary.json and summary.png")


if __name__ == "__main__":
    main()
