# python -m pardec.benchmarks.cover --mdm runs/mdm_default/hf
"""COVER against the MDM decoders it is measured with, on an MDM export of the embedded default.

Rows (same generation length and block, batch 1, greedy, one process, one after the other, each
after an untimed warm-up on two problems): LLaDA low-confidence with one token per step (the
paper's baseline, the TPS reference), Fast-dLLM threshold (prefix cache, tau 0.9), WINO (official
0.6 / 0.9), Saber (official n = 2, mu = 8), COVER (``seed_input=token``, the default), COVER with the
seeds fed masked as in the paper (``seed_input=mask``), and COVER without KV override (same settings).
COVER's tau_draft is chosen on a *validation* split first (``--taus``), by ``--select``:
``accuracy`` (best accuracy, then fewest steps) or ``baselines`` (the fewest steps among the taus
whose validation accuracy is at least the best of WINO's and Saber's there, which are then run on
validation too; the most accurate tau when none is: the operating point the issue's claim "fewer
steps at accuracy no lower" asks about). Then every row runs on the held-out test problems (``--split
fresh1``, ``fresh2``, ...: on new problems instead). The validation problems are the generator's ``val``
split (disjoint from train and test).

``--base``: the AR base the MDM came from, whose AR greedy row comes first (TPS / base AR within the
run). ``--rows``: the test rows to decode, by key (``ROW_KEYS``; all by default); without the baseline
row (``lowconf1``) the TPS / baseline column is "—". ``--chunk-dir DIR``: the test rows decoded
``--chunk-size`` problems at a time, every row on each chunk in turn, each chunk saved in DIR and
skipped when the same command runs again; the validation sweep is kept beside them (``validation.json``)
and read back, so a restart chooses the same tau without sweeping again; the table, of the problems done
so far, is rewritten after every chunk (``pardec.benchmarks.chunks``); the ``Machine:`` line names the
machine(s) that decoded the chunks, and the validation section names the one that swept it, also under
``validation_machine`` in the JSON. ``--cuda-graphs``:
every row (validation included) decodes with ``cuda_graphs=true`` (the MDM decoders' static steps,
COVER's static override forwards; on a GPU each captured as CUDA graphs before a problem is timed).

Columns: accuracy (exact ``#### n``), steps per sample (= forwards), TPF (committed tokens /
forwards), TPS, TPS / baseline and (with ``--base``) = base AR greedy (fraction of problems whose output
tokens equal the base's AR greedy output) and TPS / base AR, revisions per sample (COVER:
ReMask + Replace; WINO, Saber: ReMask), flip-flops per sample, effective-revision ratio (revisions
whose position ends with a different token, pooled). Writes ``benchmarks/results/cover.{md,json}``.
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.chunks import add_chunk_args, decode_all, decode_row, kept_in, progress_note
from pardec.benchmarks.common import (
    RESULTS,
    add_runtime_args,
    add_split_arg,
    current_machine,
    identical,
    invoked_command,
    machine_name,
    named_keys,
    or_dash,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.mdm_common import default_block_size, mdm_info
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.evaluate import evaluate
from pardec.inference.metrics import compute_metrics

SELECT_RULES = ("accuracy", "baselines")
ROW_KEYS = ("ar", "lowconf1", "threshold", "wino", "saber", "cover", "cover_mask", "cover_no_override")
AR_LABEL = "AR greedy (base)"
BASELINE_LABEL = "LLaDA low-confidence, 1 token/step (baseline)"
REVOCABLE_BASELINES = (
    ("WINO 0.6 / 0.9", {"name": "wino", "threshold": 0.6, "threshold_back": 0.9}),
    ("Saber n=2 / mu=8", {"name": "saber", "min_tokens": 2, "remask_divisor": 8}),
)


def choose_tau(tuning: list[dict], rule: str, baseline_accuracy: float | None = None) -> dict:
    """The validation row whose tau_draft the test rows use (``--select``, module docstring)."""
    most_accurate = max(tuning, key=lambda r: (r["accuracy"], -r["steps_per_sample"]))
    if rule == "accuracy":
        return most_accurate
    good = [r for r in tuning if r["accuracy"] >= baseline_accuracy]
    return min(good, key=lambda r: (r["steps_per_sample"], -r["accuracy"])) if good else most_accurate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--mdm", required=True, help="MDM export (recipe=mdm)")
    p.add_argument("--base", default=None, help="the AR base the MDM was converted from: adds its AR greedy row "
                   "(TPS / base AR within the run)")
    p.add_argument("--num-samples", type=int, default=200)
    add_split_arg(p, val=False)  # the reported problems: settings are chosen on val first
    p.add_argument("--num-validation", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None,
                   help="decoding block (default: the MDM's attention block for block models, else 32)")
    p.add_argument("--taus", default="0.7,0.8,0.9", help="COVER tau_draft grid, tuned on the validation split")
    p.add_argument("--select", choices=SELECT_RULES, default="accuracy",
                   help="how tau_draft is chosen on validation (module docstring)")
    p.add_argument("--rows", default=None, type=row_keys,
                   help=f"comma-separated test rows to decode ({', '.join(ROW_KEYS)}), or all")
    add_runtime_args(p, threads=1)
    add_chunk_args(p)
    p.add_argument("--out", default=str(RESULTS / "cover"))
    args = p.parse_args(argv)
    if args.rows and "ar" in args.rows and not args.base:
        p.error("--rows ar needs --base (the AR base whose greedy row it is)")
    return args


def row_keys(text: str) -> tuple[str, ...] | None:
    """``--rows``: the keys named, in the table's order (None for ``all``: every row, the AR one only with
    ``--base``); an unknown key is an error."""
    if text == "all":
        return None
    try:
        return named_keys(text, ROW_KEYS)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


VALIDATION_FILE = "validation.json"  # beside the chunks: the tau sweep (and the baselines' bar) the test rows used


def graphs_setting(args: argparse.Namespace) -> dict:
    """``cuda_graphs`` in every row's config only when on, so that the committed chunks of eager runs keep
    their fingerprint."""
    return {"cuda_graphs": True} if args.cuda_graphs else {}


def common_settings(args: argparse.Namespace) -> dict:
    """What every MDM row (COVER's validation included) shares."""
    return {"max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "batch_size": 1,
            **graphs_setting(args)}


def table_rows(args: argparse.Namespace, tau: float) -> list[tuple[str, dict]]:
    """(label, decoder config) of the test rows ``--rows`` names, COVER's at the chosen ``tau``; the AR row
    only with ``--base``."""
    common = common_settings(args)
    ar = {"name": "ar", "max_new_tokens": args.max_new_tokens, "batch_size": 1, **graphs_setting(args)}
    (wino_label, wino), (saber_label, saber) = REVOCABLE_BASELINES
    every = {
        "ar": (AR_LABEL, ar),
        "lowconf1": (BASELINE_LABEL, {"name": "mdm_lowconf"}),
        "threshold": ("Fast-dLLM threshold 0.9 (prefix cache)", {"name": "mdm_threshold", "threshold": 0.9}),
        "wino": (wino_label, wino),
        "saber": (saber_label, saber),
        "cover": (f"COVER tau={tau}", {"name": "cover", "draft_threshold": tau}),
        "cover_mask": (f"COVER tau={tau}, seeds fed masked (paper)",
                       {"name": "cover", "draft_threshold": tau, "seed_input": "mask"}),
        "cover_no_override": (f"COVER tau={tau} without override",
                              {"name": "cover", "draft_threshold": tau, "override": False}),
    }
    keys = args.rows or [k for k in ROW_KEYS if k != "ar" or args.base]
    return [(every[k][0], every[k][1] if k == "ar" else {**every[k][1], **common}) for k in keys]


def chunk_fingerprint(args: argparse.Namespace, rows: list[tuple[str, dict]]) -> dict:
    """What the test chunks are made by (pardec.benchmarks.chunks: a chunk of another setting is refused)."""
    split = {"split": args.split} if args.split != "test" else {}  # test chunks committed before --split keep theirs
    return {"benchmark": "cover", "mdm": args.mdm, "base": args.base, "template": args.template,
            "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "rows": [[label, decoder] for label, decoder in rows], **split}


def validation_sweep(args: argparse.Namespace) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(label, decoder config) of the validation rows: COVER at every tau of ``--taus``, and the revocable
    baselines WINO and Saber for ``--select baselines`` (else none)."""
    common = common_settings(args)
    tau_rows = [(f"COVER tau_draft={tau}", {"name": "cover", "draft_threshold": tau, **common})
                for tau in (float(t) for t in args.taus.split(","))]
    baseline_rows = ([(label, {**decoder, **common}) for label, decoder in REVOCABLE_BASELINES]
                     if args.select == "baselines" else [])
    return tau_rows, baseline_rows


def validation_fingerprint(args: argparse.Namespace) -> dict:
    """What the kept validation sweep is made by (``VALIDATION_FILE``; one of other settings is refused)."""
    tau_rows, baseline_rows = validation_sweep(args)
    return {"benchmark": "cover validation", "mdm": args.mdm, "num_validation": args.num_validation,
            "template": args.template, "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "rows": [[label, decoder] for label, decoder in tau_rows + baseline_rows]}


def metrics_row(records: list[dict], decoder: dict, tok, is_ar: bool = False) -> dict:
    """A row's columns from its records (every problem's): steps = the decoder's steps, else its forwards."""
    m = {**compute_metrics(records, is_ar), **build_decoder(decoder, tok).summarize(records)}
    return {
        "accuracy": m["accuracy"], "steps_per_sample": m.get("steps_per_sample", m["nfe_per_sample"]),
        "tpf": m["tpf"], "tps": m["tps"], "num_samples": m["num_samples"],
        "revisions_per_sample": m.get("revisions_per_sample"), "flip_flops_per_sample": m.get("flip_flops_per_sample"),
        "effective_revision_ratio": m.get("effective_revision_ratio"), "seconds": m["decode_time_s"],
    }


def decode(model, tok, problems, decoder: dict, template: str = "auto") -> list[dict]:
    """``problems`` decoded by ``decoder``: the records, in problem order."""
    result = evaluate(model, tok, problems, decoder, template=template, agreement=False, shard=False)
    return sorted(result.records, key=lambda r: r["index"])


def run(model, tok, rows, decoder: dict, warmup, template: str = "auto") -> dict:
    evaluate(model, tok, warmup, decoder, template=template, agreement=False, shard=False)  # untimed warm-up
    return metrics_row(decode(model, tok, rows, decoder, template), decoder, tok)


def table_md(table: list[dict]) -> str:
    with_ar = any(r.get("tps_vs_base_ar") is not None for r in table)
    header = ("| decoder | accuracy |" + (" = base AR greedy |" if with_ar else "")
              + " steps/sample | TPF | TPS | TPS / baseline |" + (" TPS / base AR |" if with_ar else "")
              + " revisions/sample | flip-flops/sample | eff. revision ratio |")
    lines = [header, "|---" * (9 + 2 * with_ar) + "|"]
    for r in table:
        ratio = r["effective_revision_ratio"] if r["revisions_per_sample"] else None  # 0/0: no revisions
        same = f" {or_dash(r.get('identical_to_base_ar'), '.1%')} |" if with_ar else ""
        ar = f" {or_dash(r.get('tps_vs_base_ar'), '.2f')}{'x' if r.get('tps_vs_base_ar') is not None else ''} |" \
            if with_ar else ""
        lines.append(f"| {r['decoder']} | {r['accuracy']:.1%} |{same} {r['steps_per_sample']:.2f} | {r['tpf']:.2f} | "
                     f"{r['tps']:.1f} | {or_dash(r['tps_ratio'], '.2f', 'x')} |{ar} "
                     f"{or_dash(r['revisions_per_sample'], '.2f')} | {or_dash(r['flip_flops_per_sample'], '.2f')} | "
                     f"{or_dash(ratio, '.1%')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint(args.mdm, device=args.device, dtype=args.dtype)
    base = load_checkpoint(args.base, device=args.device, dtype=args.dtype) if args.base else None
    if args.block_size is None:
        args.block_size = default_block_size(mdm_info(model))
    test = split_rows(args.split, args.num_samples)
    val = validation_rows(args.num_validation)
    warmup = test.select(range(min(2, len(test))))
    common = common_settings(args)

    tau_rows, baseline_rows = validation_sweep(args)

    def sweep() -> dict:
        """COVER at every tau (and, for ``--select baselines``, WINO and Saber) on the validation problems."""
        tuning = []
        for _, cover in tau_rows:
            tuning.append({"tau_draft": cover["draft_threshold"], **run(model, tok, val, cover, warmup, args.template)})
            print("validation", json.dumps(tuning[-1]), flush=True)
        baselines_val = []
        for label, decoder in baseline_rows:
            baselines_val.append({"decoder": label, **run(model, tok, val, decoder, warmup, args.template)})
            print("validation", json.dumps(baselines_val[-1]), flush=True)
        return {"tuning": tuning, "baselines": baselines_val, "machine": current_machine()}

    # Swept once per chunk directory (pardec.benchmarks.chunks.kept_in): a restart chooses the same tau at no cost.
    kept, kept_note = kept_in(args.chunk_dir, VALIDATION_FILE, validation_fingerprint(args), sweep, [args.mdm])
    tuning, baselines_val, validation_machine = kept["tuning"], kept["baselines"], kept["machine"]
    baseline_accuracy = max((r["accuracy"] for r in baselines_val), default=None)
    tau = choose_tau(tuning, args.select, baseline_accuracy)["tau_draft"]

    rows = table_rows(args, tau)
    warmed = set()

    def run_chunk(problems, first: int) -> dict[str, list[dict]]:
        """Every test row on ``problems`` (the first numbered ``first``), one after the other, each warmed up
        once (:func:`pardec.benchmarks.chunks.decode_row`)."""
        return {label: decode_row(*(base if label == AR_LABEL else (model, tok)), problems, decoder, args.template,
                                  warmed, label, first)
                for label, decoder in rows}

    def write_table(records: dict[str, list[dict]], done: int, machine: dict) -> None:
        table = [{"decoder": label, "config": {k: v for k, v in decoder.items() if k not in common},
                  **metrics_row(records[label], decoder, base[1] if label == AR_LABEL else tok, label == AR_LABEL)}
                 for label, decoder in rows]
        by_label = {r["decoder"]: r for r in table}
        for r in table:
            r["tps_ratio"] = r["tps"] / by_label[BASELINE_LABEL]["tps"] if BASELINE_LABEL in by_label else None
            r["tps_vs_base_ar"] = r["tps"] / by_label[AR_LABEL]["tps"] if AR_LABEL in by_label else None
            r["identical_to_base_ar"] = (identical(records[r["decoder"]], records[AR_LABEL])
                                        if AR_LABEL in records else None)
        md = table_md(table)
        tune_md = "\n".join(["| tau_draft | accuracy | steps/sample | eff. revision ratio |", "|---|---|---|---|"] + [
            f"| {r['tau_draft']} | {r['accuracy']:.1%} | {r['steps_per_sample']:.2f} | "
            f"{r['effective_revision_ratio']:.1%} |" for r in tuning])
        if baselines_val:
            tune_md += "\n\nRevocable baselines on validation (the bar for --select baselines):\n\n" + "\n".join(
                ["| decoder | accuracy | steps/sample |", "|---|---|---|"]
                + [f"| {r['decoder']} | {r['accuracy']:.1%} | {r['steps_per_sample']:.2f} |" for r in baselines_val])
        print(md, flush=True)
        progress = progress_note(args.chunk_dir, args.chunk_size, done, len(test))
        write_results(args.out, invoked_command("pardec.benchmarks.cover", argv),
                      f"Checkpoint: {args.mdm}{f' (AR row: {args.base})' if base else ''}. Test: the first {done} "
                      f"problems of the {split_label(args.split)}{progress}; COVER's tau_draft tuned on the first "
                      f"{args.num_validation} problems of the generator's val split. Block {args.block_size}, "
                      f"{args.max_new_tokens} new tokens, batch 1, {args.dtype} on {args.device} "
                      f"({args.threads} threads"
                      f"{', every forward a CUDA graph' if args.cuda_graphs else ''}), template "
                      f"{args.template}.\n\nValidation (COVER; "
                      f"{kept_note or f'decoded on {machine_name(validation_machine)}'}):\n\n{tune_md}\n\n"
                      f"Test:\n\n{md}",
                      {"validation": tuning, "validation_baselines": baselines_val,
                       "validation_machine": validation_machine, "test": table}, machine=machine)

    decode_all(test, args.chunk_dir, args.chunk_size, chunk_fingerprint(args, rows), run_chunk, write_table,
               checkpoints=[args.mdm] + ([args.base] if args.base else []))


if __name__ == "__main__":
    main()
