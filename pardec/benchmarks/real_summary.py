# python -m pardec.benchmarks.real_summary     (the last step of: bash scripts/reproduce.sh --real)
"""Every conversion of SmolLM2-135M-Instruct side by side, and the plot of both bases.

Nothing is measured here: the rows are read from the JSON the real-model benchmarks wrote under
``benchmarks/results/real/`` (the same columns as the embedded summary, ``pardec.benchmarks.summary``,
plus the hardware and the number of test problems: a CPU row names the CPU its benchmark ran on where
``machines.json`` records it, since TPS ratios move with the kind of CPU), the CPU conversion wall times from the
``cpu_conversions.json`` the reproduce driver keeps there (``pardec.cli.reproduce --real``) and the GPU
ones from the ``gpu_conversions_<gpu>.json`` the GPU runs left (``scripts/real_model_gpu.sh``). A row whose
benchmark has not been run yet is listed below the table with the command that makes it, so the table grows
as conversions land. Below it, the CPU each CPU conversion time was measured on and, once both val tables
exist, the MDM attention (block-causal or bidirectional) chosen on val.

Writes ``summary.md``, ``summary.json`` and ``summary.png`` to ``--out-dir`` (default
``benchmarks/results/real``): accuracy against TPS / base AR for every decoder on both bases, the
embedded default's rows read from ``benchmarks/results/summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from pardec.benchmarks.common import MACHINES, RESULTS, or_dash
from pardec.benchmarks.summary import (
    SOURCES,
    cover_chosen,
    lossless_status,
    minutes,
    refusion_chosen,
    refusion_lossless,
)
from pardec.benchmarks.summary import conversion_seconds as cpu_conversion_seconds

REAL_RESULTS = RESULTS / "real"


@dataclasses.dataclass(frozen=True)
class RealRow:
    """One (checkpoint, decoder) on SmolLM2: ``source`` is the results file's stem, ``kind`` the
    benchmark that wrote it (a key of ``pardec.benchmarks.summary.SOURCES``: how its rows are read),
    ``decoder`` the row label in it (or a callable that picks it from the JSON, e.g. the setting chosen
    on validation), ``short`` its label in the plot (a string or such a callable); ``conversion`` the
    run that trained the checkpoint (its wall time's key);
    ``lossless`` the AR greedy the decoder reproduces by construction ("base" or "own"), None for no
    claim (or a callable that reads it from the JSON, where it depends on the setting chosen on val).
    An ``optional`` row is one its table may lack by design: its ``decoder`` callable returns None
    there, and it is neither in the table nor listed as not measured."""

    method: str
    checkpoint: str
    hardware: str
    source: str
    kind: str
    decoder: str | Callable[[object], str | None]
    short: str | Callable[[object], str]  # plot label (a callable reads the setting chosen on val)
    conversion: str
    lossless: str | None | Callable[[object], str | None]
    command: str
    optional: bool = False


CPU = "CPU, 2 cores"
H100 = "H100"
H200_GRAPHS = "H200, CUDA graphs"
RISD_CPU = "python -m pardec.cli.reproduce --real --only smollm2_risd cpu_risd"
GPU_RUN = "PROBLEMS=30 bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)"
GPU_RUN_H200 = "PROBLEMS=30 RISD=0 EVAL_SPLITS=test bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)"
IDLM_CPU = "python -m pardec.cli.reproduce --real --only smollm2_idlm_lora cpu_idlm"
REFUSION_CPU = "python -m pardec.cli.reproduce --real --only smollm2_refusion_lora_3000 cpu_refusion"
JACOBI_CPU = "python -m pardec.cli.reproduce --real --only smollm2_jacobi_forcing_lora_1500 cpu_jacobi_forcing"
MDM_CPU = "python -m pardec.cli.reproduce --real --only smollm2_mdm_lora_2000 cpu_mdm_flashdlm"
COVER_CPU = "python -m pardec.cli.reproduce --real --only smollm2_mdm_lora_2000 cpu_cover"
MDM_BLOCK8_CPU = "python -m pardec.cli.reproduce --real --only smollm2_mdm_lora_2000_block8 cpu_mdm_flashdlm_block8"
COVER_BLOCK8_CPU = "python -m pardec.cli.reproduce --real --only smollm2_mdm_lora_2000_block8 cpu_cover_block8"
H200 = "H200"
GPU_RUN_MDM = ("PROBLEMS=20 IDLM=0 MDM=1 MDM_TABLES=flashdlm DECODE_MODES=graphs EVAL_SPLITS= "
               "bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)")
GPU_RUN_REFUSION = ("PROBLEMS=20 IDLM=0 REFUSION=1 REFUSION_VAL=6 DECODE_MODES=graphs EVAL_SPLITS= "
                    "bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)")
MDM_FLASHDLM_ROWS = (  # (label in the mdm_flashdlm table, plot label, lossless w.r.t.)
    ("MDM low-confidence, 1 token/step (baseline)", "LLaDA 1/step", None),
    ("MDM Fast-dLLM threshold tau=0.9 (prefix cache)", "Fast-dLLM", None),
    ("FreeCache (refresh), low-confidence 1/step", "FreeCache", None),
    ("FreeCache + guided (assisted, strict)", "FreeCache+guided", None),
    ("Guided (shifted, strict; = base AR greedy)", "guided (shifted)", "base"),
)
ISD = "idlm_isd"
GPU_RUN_MDM_32 = ("PROBLEMS=20 IDLM=0 MDM=1 MDM_ATTENTION={attention} EVAL_SPLITS= MDM_TABLES='cover flashdlm' "
                  "COVER_VAL=6 MDM_ROWS=ar,lowconf1,guided_shifted,fc_guided_strict,fc_refresh "
                  "bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)")
COVER_ROWS = (("WINO 0.6 / 0.9", "WINO"), ("Saber n=2 / mu=8", "Saber"), (cover_chosen, "COVER"))
MDM_CPU_CHECKPOINT = "MDM (block 2, LoRA r=64, 2000 steps) on the CPU SFT base as an Intel CPU re-built it"
MDM_BLOCK8_CPU_CHECKPOINT = "MDM (block 8, LoRA r=64, 2000 steps) on the CPU SFT base"
MDM_BLOCK8_ROWS = ("LLaDA 1/step", "FreeCache", "FreeCache+guided")  # the rows of the 6x goal, by plot label
GPU_RUN_JACOBI = ("PROBLEMS=20 IDLM=0 JACOBI=1 JACOBI_VAL=6 DECODE_MODES=graphs EVAL_SPLITS= "
                  "bash scripts/real_model_gpu.sh (docs/results/real_gpu.md)")


def jacobi_chosen(kind: str) -> Callable[[dict], str]:
    """The Jacobi (``kind="jacobi"``) or multi-block row at the block size the benchmark chose on val
    (``jacobi_forcing --num-val``)."""
    return lambda data: data["chosen_labels"][kind]


def jacobi_short(kind: str, short: str) -> Callable[[dict], str]:
    """``Jacobi n=8``: the row's short label with the n it decodes at (multi-block's own when it was chosen
    on its own, ``--choose-multiblock-n``; tables from before that option record only Jacobi's)."""
    key = {"jacobi": "chosen_block_size", "multiblock": "chosen_multiblock_block_size"}[kind]
    return lambda data: f"{short} n={data.get(key, data['chosen_block_size'])}"


def isd_chosen(data) -> str:
    """The greedy ISD row at the N the benchmark chose on val (``idlm_isd --num-val``)."""
    return f"ISD N={data['chosen_stride']} greedy"


ISD_GOAL_STRIDE = 4  # the N whose TPF goal the CPU table answers (docs/results/real_cpu.md)


def isd_at_goal_stride(data) -> str | None:
    """The greedy ISD test row at ``ISD_GOAL_STRIDE`` beside the one chosen on val (``idlm_isd
    --test-strides 4``); None, so no second row, where val chose that N or the table has no such row."""
    if data["chosen_stride"] == ISD_GOAL_STRIDE or ISD_GOAL_STRIDE not in data.get("test_strides", []):
        return None
    return f"ISD N={ISD_GOAL_STRIDE} greedy"


ROWS: tuple[RealRow, ...] = (
    RealRow("AR", "SmolLM2 SFT (CPU)", CPU, "cpu_risd", ISD, "AR greedy (base)", "AR greedy", "smollm2_sft", "base",
            RISD_CPU),
    RealRow("R-ISD", "gated LoRA on the CPU SFT base", CPU, "cpu_risd", ISD, "R-ISD N=3 greedy (gated LoRA)",
            "R-ISD N=3", "smollm2_risd", "base", RISD_CPU),
    *(RealRow("I-DLM", "I-DLM (stride 4, LoRA r=64) on the CPU SFT base", CPU,
              "cpu_idlm", ISD, decoder, lambda data, decoder=decoder: decoder(data).removesuffix(" greedy"),
              "smollm2_idlm_lora", "own", IDLM_CPU, optional=decoder is isd_at_goal_stride)
      for decoder in (isd_chosen, isd_at_goal_stride)),
    *(RealRow("Jacobi Forcing", "Jacobi Forcing round 1 (LoRA r=64, 1500 steps) on the CPU SFT base", CPU,
              "cpu_jacobi_forcing", "jacobi_forcing", jacobi_chosen(kind),
              jacobi_short(kind, short), "smollm2_jacobi_forcing_lora_1500", "own", JACOBI_CPU)
      for kind, short in (("jacobi", "Jacobi"), ("multiblock", "multi-block"))),
    RealRow("ReFusion", "ReFusion (LoRA r=64, 3000 steps) on the CPU SFT base", CPU,
            "cpu_refusion", "refusion", refusion_chosen, "ReFusion", "smollm2_refusion_lora_3000", refusion_lossless,
            REFUSION_CPU),
    # The FlashDLM and COVER rows decode the pipeline's MDM conversion (pardec/cli/reproduce.py, REAL_MDM).
    *(RealRow("MDM", MDM_CPU_CHECKPOINT, CPU, "cpu_mdm_flashdlm", "mdm_flashdlm", label, short,
              "smollm2_mdm_lora_2000", lossless, MDM_CPU)
      for label, short, lossless in MDM_FLASHDLM_ROWS),
    *(RealRow("MDM", MDM_CPU_CHECKPOINT, CPU, "cpu_cover", "cover", label, short, "smollm2_mdm_lora_2000", None,
              COVER_CPU)
      for label, short in COVER_ROWS),
    # The same conversion in blocks of 8 (REAL_MDM_BLOCK8), decoded in blocks of 8: the 6x goal's rows only,
    # and COVER's table (its goal's rows).
    *(RealRow("MDM", MDM_BLOCK8_CPU_CHECKPOINT, CPU, "cpu_mdm_flashdlm_block8", "mdm_flashdlm", label,
              f"{short}, block 8", "smollm2_mdm_lora_2000_block8", lossless, MDM_BLOCK8_CPU)
      for label, short, lossless in MDM_FLASHDLM_ROWS if short in MDM_BLOCK8_ROWS),
    *(RealRow("MDM", MDM_BLOCK8_CPU_CHECKPOINT, CPU, "cpu_cover_block8", "cover", label, f"{short}, block 8",
              "smollm2_mdm_lora_2000_block8", None, COVER_BLOCK8_CPU)
      for label, short in COVER_ROWS),
    # The two GPU runs fine-tuned their own SFT base (same recipe, another machine): each row names its run's.
    RealRow("AR", "SmolLM2 SFT (GPU, H100 run)", H100, "gpu_risd_h100", ISD, "AR greedy (base)", "AR greedy",
            "smollm2_sft_gpu@h100", "base", GPU_RUN),
    RealRow("R-ISD", "gated LoRA on the H100 run's SFT base", H100, "gpu_risd_h100", ISD,
            "R-ISD N=3 greedy (gated LoRA)", "R-ISD N=3", "smollm2_risd_gpu@h100", "base", GPU_RUN),
    RealRow("AR", "SmolLM2 SFT (GPU, H200 run)", H200_GRAPHS, "gpu_idlm_isd_graphs_h200", ISD, "AR greedy (base)",
            "AR greedy", "smollm2_sft_gpu@h200", "base", GPU_RUN_H200),
    RealRow("I-DLM", "I-DLM (stride 4) on the H200 run's SFT base", H200_GRAPHS, "gpu_idlm_isd_graphs_h200", ISD,
            "ISD N=4 greedy", "ISD N=4", "smollm2_idlm_gpu@h200", "own", GPU_RUN_H200),
    # The sixth H200 session (2026-12-04): ReFusion and the block-2 MDM on that session's SFT base, every row's
    # decode step a CUDA graph (the block-2 MDM's eager table of an earlier conversion, gpu_mdm_flashdlm_h200, is in
    # docs/results/real_gpu.md; its conversion's wall time was replaced by this session's).
    RealRow("ReFusion", "ReFusion on the sixth H200 run's SFT base", H200_GRAPHS, "gpu_refusion_graphs_h200",
            "refusion", refusion_chosen, "ReFusion", "smollm2_refusion_gpu@h200", None, GPU_RUN_REFUSION),
    *(RealRow("MDM", "MDM (block 2) on the sixth H200 run's SFT base", H200_GRAPHS, "gpu_mdm_flashdlm_graphs_h200",
              "mdm_flashdlm", label, short, "smollm2_mdm_gpu@h200", lossless, GPU_RUN_MDM)
      for label, short, lossless in MDM_FLASHDLM_ROWS),
    # A third H200 session: blocks of 32, bidirectional and block-causal, both on that session's SFT base (eager;
    # Fast-dLLM is in the COVER tables, which have no AR row: TPS / base AR "—" there).
    *(RealRow("MDM", "MDM (bidirectional, block 32) on the third H200 run's SFT base", H200,
              "gpu_mdm_flashdlm_bidir_h200", "mdm_flashdlm", label, f"{short}, bidir-32", "smollm2_mdm_bidir_gpu@h200",
              lossless,
              GPU_RUN_MDM_32.format(attention="bidir"))
      for label, short, lossless in MDM_FLASHDLM_ROWS if short != "Fast-dLLM"),
    *(RealRow("MDM", f"MDM ({name}, block 32) on the third H200 run's SFT base", H200, f"gpu_cover_{key}_h200", "cover",
              label, f"{short}, {key}", f"smollm2_mdm_{key}_gpu@h200", None, GPU_RUN_MDM_32.format(attention=key))
      for key, name in (("bidir", "bidirectional"), ("block32", "block-causal")) for label, short in COVER_ROWS),
    # A fifth H200 session: Jacobi Forcing on that session's SFT base, every row's decode step a CUDA graph.
    *(RealRow("Jacobi Forcing", "Jacobi Forcing round 1 on the fifth H200 run's SFT base", H200_GRAPHS,
              "gpu_jacobi_forcing_graphs_h200", "jacobi_forcing", jacobi_chosen(kind), jacobi_short(kind, short),
              "smollm2_jacobi_forcing_gpu@h200", "own", GPU_RUN_JACOBI)
      for kind, short in (("jacobi", "Jacobi"), ("multiblock", "multi-block"))),
)


def conversion_seconds(results_dir: Path) -> dict[str, float]:
    """Wall seconds per conversion: the CPU reproduce run's ``cpu_conversions.json`` (keyed by experiment),
    then each GPU run's ``gpu_conversions_<gpu>.json`` (keyed ``<experiment>@<gpu>``: each GPU run trains
    its own base)."""
    seconds = cpu_conversion_seconds(results_dir)
    for path in sorted(results_dir.glob("gpu_conversions_*.json")):
        gpu = path.stem.removeprefix("gpu_conversions_")
        seconds.update({f"{k}@{gpu}": v["wall_seconds"] for k, v in json.loads(path.read_text()).items()})
    return seconds


def benchmark_cpus(results_dir: Path) -> dict[str, str]:
    """``{table stem: CPU}`` for the CPU tables ``machines.json`` names a CPU for (written with every table by
    ``pardec.benchmarks.common.write_results``; tables from before it did are absent)."""
    path = results_dir / MACHINES
    tables = json.loads(path.read_text()) if path.is_file() else {}
    return {name: entry["cpu"] for name, entry in tables.items() if entry.get("cpu") and not entry.get("gpu")}


def build(results_dir: Path, seconds: dict[str, float]) -> tuple[list[dict], list[RealRow]]:
    """(table rows, rows whose results file does not exist yet). A CPU row's hardware is the CPU its table
    was run on where recorded, else ``CPU``; ``gpu`` says which rows ran on a GPU."""
    table, missing = [], []
    cpus = benchmark_cpus(results_dir)
    for row in ROWS:
        path = results_dir / f"{row.source}.json"
        if not path.is_file():
            if not row.optional:
                missing.append(row)
            continue
        source, data = SOURCES[row.kind], json.loads(path.read_text())
        label = row.decoder(data) if callable(row.decoder) else row.decoder
        if label is None and row.optional:
            continue
        by_label = {r["decoder"]: r for r in source.rows(data)}
        if label not in by_label:
            raise SystemExit(f"{path} has no row {label!r} (rows: {sorted(by_label)}); re-run `{row.command}`")
        result = by_label[label]
        base_identity = result.get(source.identical_to_base) if source.identical_to_base else None
        own_identity = result.get(source.identical_to_own) if source.identical_to_own else None
        claim = row.lossless(data) if callable(row.lossless) else row.lossless
        verified, lossless = lossless_status(dataclasses.replace(row, lossless=claim), base_identity, own_identity)
        table.append({
            "method": row.method, "checkpoint": row.checkpoint, "decoder": label, "gpu": row.hardware != CPU,
            "hardware": cpus.get(row.source, CPU) if row.hardware == CPU else row.hardware,
            "source": row.source, "accuracy": result["accuracy"], "identical_to_base": base_identity,
            "tpf": result["tpf"], "tps_ratio": result.get(source.tps_ratio) if source.tps_ratio else None,
            "lossless": lossless,
            "lossless_verified": verified, "conversion": row.conversion,
            "conversion_seconds": seconds.get(row.conversion),
            "short": row.short(data) if callable(row.short) else row.short,
            "num_problems": result.get("num_samples"),
        })
    return table, missing


# The two SmolLM2 MDM conversions compared on val (reproduce steps cpu_mdm_val_<key>): same budget,
# each decoded in its own block (docs/results/real_cpu.md).
MDM_ATTENTIONS = {"block": ("block-causal, blocks of 2", "smollm2_mdm"),
                  "bidir": ("bidirectional", "smollm2_mdm_bidir")}
MDM_VAL_COMMAND = "python -m pardec.cli.reproduce --real --only smollm2_mdm_bidir cpu_mdm_val_block cpu_mdm_val_bidir"


def grouped_by_machine(machine_of: dict[str, str | None]) -> str:
    """``{name: machine or None}`` -> "M1: `a`, `b`; not recorded: `c`" (machines in first-seen order)."""
    names: dict[str, list[str]] = {}
    for name, machine in machine_of.items():
        names.setdefault(machine or "not recorded", []).append(f"`{name}`")
    return "; ".join(f"{machine}: {', '.join(group)}" for machine, group in names.items())


def cpu_machines(results_dir: Path) -> str | None:
    """Which CPU each CPU conversion's wall time was measured on (the ``machine`` the reproduce driver
    records in ``cpu_conversions.json``; the benchmarks' CPUs are in the table's hardware column): entries
    from before it did are "not recorded", and conversions no row decodes (an experiment kept on record) are
    left out. One line below the table, or None when no entry names a machine."""
    path = results_dir / "cpu_conversions.json"
    conversions = json.loads(path.read_text()) if path.is_file() else {}
    decoded = {row.conversion for row in ROWS if row.hardware == CPU}
    conversion_machines = {name: entry.get("machine") for name, entry in conversions.items() if name in decoded}
    if not any(conversion_machines.values()):
        return None
    return f"CPU conversion wall times were measured on: {grouped_by_machine(conversion_machines)}."


def mdm_attention_choice(results_dir: Path) -> str | None:
    """The MDM attention chosen on val, or None before both val tables exist. Rule: the higher LLaDA
    baseline accuracy (``lowconf1``), then the higher Fast-dLLM accuracy (``threshold``), then
    block-causal (the one the test tables were first run on)."""
    scores = {}
    for key in MDM_ATTENTIONS:
        path = results_dir / f"cpu_mdm_val_{key}.json"
        if not path.is_file():
            return None
        rows = {r["key"]: r for r in json.loads(path.read_text())}
        missing = {"lowconf1", "threshold"} - set(rows)
        if missing:
            raise SystemExit(f"{path} has no row(s) {sorted(missing)}; re-run `{MDM_VAL_COMMAND}`")
        scores[key] = (rows["lowconf1"]["accuracy"], rows["threshold"]["accuracy"], rows["lowconf1"]["num_samples"])
    chosen = max(MDM_ATTENTIONS, key=lambda k: (scores[k][0], scores[k][1], k == "block"))
    parts = [f"{MDM_ATTENTIONS[k][0]} (`{MDM_ATTENTIONS[k][1]}`): LLaDA baseline {scores[k][0]:.1%}, "
             f"Fast-dLLM {scores[k][1]:.1%}" for k in MDM_ATTENTIONS]
    tested = ("the CPU MDM rows above are of its block-causal LoRA successor (`smollm2_mdm_lora_2000`) and of "
              "that conversion in blocks of 8 (`smollm2_mdm_lora_2000_block8`, not chosen on val: the rows of the "
              "FreeCache + guided and COVER goals)") if chosen == "block" else (
        "the MDM rows above are still of block-causal conversions (the chosen one's test tables are not run yet)")
    return (f"MDM attention, chosen on {scores['block'][2]} val problems (`{MDM_VAL_COMMAND}`): "
            f"{'; '.join(parts)}. Chosen: **{MDM_ATTENTIONS[chosen][0]}**; {tested}.")


def markdown(table: list[dict], missing: list[RealRow]) -> str:
    lines = ["| method | checkpoint | decoder | hardware | test problems | accuracy | = base AR | TPF | "
             "TPS / base AR | lossless | conversion wall time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        base = " (the base's fine-tuning)" if r["method"] == "AR" else ""
        lines.append(f"| {r['method']} | {r['checkpoint']} | {r['decoder']} | {r['hardware']} | "
                     f"{or_dash(r['num_problems'], 'd')} | {r['accuracy']:.1%} | "
                     f"{or_dash(r['identical_to_base'], '.1%')} | {r['tpf']:.2f} | "
                     f"{or_dash(r['tps_ratio'], '.2f', 'x')} | "
                     f"{r['lossless']} | {minutes(r['conversion_seconds'])}{base} |")
    if missing:
        lines += ["", "Not measured yet:"]
        named = lambda r: r.decoder if isinstance(r.decoder, str) else (  # noqa: E731
            f"{r.short if isinstance(r.short, str) else r.method} (chosen on val)")
        lines += [f"- {r.method}, {r.checkpoint}, {named(r)} ({r.hardware}): `{r.command}`" for r in missing]
    return "\n".join(lines)


def plot(embedded: list[dict], real: list[dict], path: Path) -> None:
    """Accuracy against TPS / base AR, one panel per base; colour per method, lossless (verified)
    decoders as stars, filled for the CPU and hollow for a GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pardec.benchmarks.plot_labels import label_points

    methods = list(dict.fromkeys(r["method"] for r in [*embedded, *real]))
    colours = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, 2, figsize=(14, 6), dpi=120)
    panels = [(axes[0], embedded, "embedded default (0.8M, CPU)"), (axes[1], real, "SmolLM2-135M-Instruct")]
    labels = []  # (axes, [(x, y, text)]) placed once the layout is final
    for ax, rows, title in panels:
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.set_xlabel("TPS / base AR greedy (same run)")
        shown = [r for r in rows if r.get("tps_ratio") is not None]
        if shown:
            ratios, accuracies = [r["tps_ratio"] for r in shown], [100 * r["accuracy"] for r in shown]
            ax.set_xlim(min(0.5, min(ratios) - 0.1), max(ratios) + 0.3)
            top = max(accuracies)
            ax.set_ylim(min(accuracies) - 3, top + (4 if top > 99 else 2))  # labels of 100% points go above
        for r in shown:
            gpu = r.get("gpu", False)
            colour = colours[r["method"]]
            ax.scatter(r["tps_ratio"], 100 * r["accuracy"], marker="*" if r["lossless_verified"] else "o",
                       s=180 if r["lossless_verified"] else 60, edgecolors=colour if gpu else "black",
                       facecolors="none" if gpu else colour, linewidths=1.2, zorder=3)
        labels.append((ax, [(r["tps_ratio"], 100 * r["accuracy"],
                             r["short"] + (f" ({r['hardware']})" if r.get("gpu", False) else ""))
                            for r in shown]))
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].set_ylabel("accuracy on the held-out test problems (%)")
    for m in methods:
        axes[1].scatter([], [], color=colours[m], marker="o", label=m)
    axes[1].scatter([], [], color="white", edgecolors="black", marker="*", s=180, label="lossless (verified)")
    axes[1].scatter([], [], facecolors="none", edgecolors="black", marker="o", label="GPU (hollow)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    for ax, points in labels:  # after the layout: the labels are placed in pixels
        label_points(ax, points)
    fig.savefig(path, dpi=fig.dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=REAL_RESULTS, help="where the real-model benchmarks wrote")
    p.add_argument("--embedded", type=Path, default=RESULTS / "summary.json", help="the embedded summary's JSON")
    p.add_argument("--out-dir", type=Path, default=REAL_RESULTS)
    args = p.parse_args(argv)

    table, missing = build(args.results_dir, conversion_seconds(args.results_dir))
    if not table:
        raise SystemExit(f"no real-model results in {args.results_dir}: run `bash scripts/reproduce.sh --real`")
    md = markdown(table, missing)
    for note in (cpu_machines(args.results_dir), mdm_attention_choice(args.results_dir)):
        if note:
            md += "\n\n" + note
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.md").write_text(
        "Command: python -m pardec.benchmarks.real_summary (reads the real-model benchmarks' JSON in this folder, "
        "cpu_conversions.json, gpu_conversions_*.json and machines.json; see the module docstring)\n\n" + md + "\n")
    (args.out_dir / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    embedded = json.loads(args.embedded.read_text()) if args.embedded.is_file() else []
    plot(embedded, table, args.out_dir / "summary.png")
    print(md)
    print(f"\nwrote {args.out_dir / 'summary.md'}, summary.json and summary.png")


if __name__ == "__main__":
    main()
