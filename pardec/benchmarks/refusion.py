# python -m pardec.benchmarks.refusion --base runs/default_base/hf --refusion runs/refusion_default/hf
"""ReFusion: AR greedy of the base vs plan-and-infill over a sweep of (b, tau, first token).

One run, two phases, every row at batch 1 in this process after an untimed warm-up on two problems
(so TPS are comparable; TPS ratios are to the base's AR greedy of the same phase):

1. **Tuning on the validation split** (``--num-val`` problems of the generator's ``val`` split,
   disjoint from train and test): AR greedy of the base and of the ReFusion checkpoint itself, then
   ReFusion (KV reuse) at every semi-AR block size b of ``--block-sizes``, every threshold tau of
   ``--thresholds`` (tau sets both the plan and the verify threshold) and every source of a slot's
   first token of ``--first-tokens`` (``mask``: the paper's plan; ``ar``: the AR head, only at b = k),
   every row with ``--completion-drafts`` (speculative completion, beyond the paper; 0 = off).
   The chosen setting is the one with the highest TPF whose validation accuracy is within
   ``--max-drop`` points of the base's (the most accurate one when none is).
2. **Test** (the first ``--num-samples`` held-out test problems; ``--split fresh1``: new problems
   instead): the two AR greedy rows, ReFusion at the chosen b and first-token source and every tau
   of the sweep with KV reuse, and the chosen
   setting again with ``kv_reuse=false`` (the whole context recomputed every forward, the paper's
   ablation), with ``fuse_plan=false`` (a plan forward every step: the same tokens, more forwards),
   at b = k with the other first-token source, and with speculative completion on, without it
   (``completion_drafts=0``: the same tokens greedy, one token per slot per completion forward).
   ``--test-chosen-only`` keeps the chosen tau alone, ``--ablations`` picks among the four,
   ``--no-own-ar`` drops the checkpoint's own AR greedy rows (then "= own AR greedy" is "—"): how a
   run on a real model fits in a CPU budget.

``--chunk-dir DIR``: the test rows decoded ``--chunk-size`` problems at a time, every row on each chunk in turn
(so a drift of the machine's speed reaches a row and its reference alike), each chunk saved in DIR and skipped
when the same command runs again; the table of the problems done so far is rewritten after every chunk
(``pardec.benchmarks.chunks``). The val sweep's table is kept beside the chunks (``validation.json``) and read
on restart, and the setting is chosen from it: a restart decodes the same rows, and a table read back from its
chunks is the same table.

The goals are flags (``--goal-tpf``, ``--goal-drop``, ``--goal-reuse``): the embedded default's are the
defaults; the real-model run asks within 3 points and KV reuse >= 2x (``reproduce --real``).

Columns: accuracy (exact ``#### n``); = base AR greedy (share of samples whose output tokens equal the
base's AR greedy output exactly); TPF = committed tokens / decoding forwards and NFE per sample
(docs/methods/conventions.md#counting: prefill excluded, nothing after EOS); TPS and TPS / base AR; slots / step
= slots
accepted per plan-and-infill iteration. Slot size k: the checkpoint's ``pardec.slot_size`` unless
``--slot-size``. With b = k every step completes one slot. Its first token comes from the plan (the
mask head) with ``first_token=mask``, so that is not lossless with respect to the checkpoint's own AR
greedy; with ``first_token=ar`` and tau >= 0.5 it is (``pardec.inference.decoders.refusion``).
No TPF · t(1)/t(q) bound column (as the I-DLM and Jacobi tables have): a step's plan, verify and
completion forwards each have their own width, which varies with the slots selected and accepted, so
no single q describes a row (the multi-block rows of the Jacobi table have none for the same reason).

Writes ``benchmarks/results/refusion.{md,json}``.
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.chunks import Machine, Records, add_chunk_args, decode_all, decode_rows, kept_in, progress_note
from pardec.benchmarks.common import (
    RESULTS,
    add_runtime_args,
    add_split_arg,
    identical,
    invoked_command,
    or_dash,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.refusion import resolve_slot_size, summarize_records
from pardec.inference.metrics import compute_metrics

OWN_AR = "AR greedy (ReFusion checkpoint)"
SETTING_KEYS = ("block_size", "threshold", "first_token", "completion_drafts")
ABLATIONS = ("kv_reuse", "fuse_plan", "first_token", "completion_drafts")
VALIDATION_FILE = "validation.json"  # beside the chunks: the --num-val sweep's table (the choice is made from it)
Row = tuple[str, str, dict]  # (label, model: "base" or "refusion", decoder config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--refusion", required=True, help="ReFusion export (recipe=refusion)")
    p.add_argument("--num-samples", type=int, default=200, help="test problems")
    add_split_arg(p, val=False)  # the reported problems: settings are chosen on val first
    p.add_argument("--num-val", type=int, default=200, help="validation problems (tuning)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    p.add_argument("--max-drop", type=float, default=0.02, help="accuracy drop tolerated when choosing (b, tau)")
    p.add_argument("--slot-size", type=int, default=None, help="default: the checkpoint's pardec.slot_size")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16],
                   help="semi-AR block sizes b swept on validation (multiples of the slot size)")
    p.add_argument("--first-tokens", nargs="+", default=["mask", "ar"], choices=["mask", "ar"],
                   help="sources of a slot's first token swept on validation (ar only where b = k)")
    p.add_argument("--completion-drafts", type=_drafts, default=0,
                   help="speculative completion for every ReFusion row: plan drafts a completion forward feeds per "
                        "slot (decoder.completion_drafts; 0 = off, the paper; all = every remaining one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--test-chosen-only", action="store_true", help="test phase: the chosen tau only, no tau sweep")
    p.add_argument("--ablations", nargs="*", default=list(ABLATIONS), choices=list(ABLATIONS),
                   help="ablations of the chosen setting on the test split (first_token only where b = k)")
    p.add_argument("--no-own-ar", action="store_true", help="skip the ReFusion checkpoint's own AR greedy rows")
    p.add_argument("--goal-tpf", type=float, default=2.5, help="goal: TPF at least this ...")
    p.add_argument("--goal-drop", type=float, default=0.02, help="... within this accuracy drop of the base")
    p.add_argument("--goal-reuse", type=float, default=1.5, help="goal: KV reuse TPS / recomputation TPS")
    add_runtime_args(p)
    add_chunk_args(p)
    p.add_argument("--out", default=str(RESULTS / "refusion"))
    return p.parse_args(argv)


def _drafts(text: str) -> int | None:
    """``--completion-drafts``: a count >= 0, or ``all`` (None: every remaining draft)."""
    if text == "all":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--completion-drafts {text}: must be >= 0 or 'all'")
    return value


def ablations(setting: dict, slot_size: int, which=ABLATIONS) -> list[dict]:
    """The test phase's variants of the chosen setting among ``which``: recomputation (``kv_reuse``),
    a plan forward every step (``fuse_plan``), at b = k the other first-token source, and where the
    setting completes speculatively, completion one token per forward (``completion_drafts``)."""
    out = [{key: False} for key in ("kv_reuse", "fuse_plan") if key in which]
    if "first_token" in which and setting["block_size"] == slot_size:
        out.append({"first_token": "mask" if setting["first_token"] == "ar" else "ar"})
    if "completion_drafts" in which and setting.get("completion_drafts", 0) != 0:
        out.append({"completion_drafts": 0})
    return out


def label(setting: dict, **ablation) -> str:
    """``setting``: block_size, threshold, first_token (and completion_drafts when not 0); ``ablation``:
    overrides, named after them (the first-token source and the completion drafts replace the setting's)."""
    first = ablation.pop("first_token", setting["first_token"])
    drafts = ablation.pop("completion_drafts", setting.get("completion_drafts", 0))
    text = f"ReFusion b={setting['block_size']} tau={setting['threshold']:g} first_token={first}"
    if drafts != 0:
        text += f" completion_drafts={'all' if drafts is None else drafts}"
    return text + "".join(f", {k}={str(v).lower()}" for k, v in ablation.items())


def phase_rows(args, settings: list[dict], slot_size: int, ablate: dict | None = None) -> list[Row]:
    """A phase's rows, in table order: AR greedy of the base and (unless ``--no-own-ar``) of the ReFusion
    checkpoint, then ReFusion at every setting of ``settings``, and at ``ablate`` once per entry of
    :func:`ablations`."""
    common = {"max_new_tokens": args.max_new_tokens, "batch_size": 1, "cuda_graphs": args.cuda_graphs}
    refusion = {"name": "refusion", **common, "slot_size": args.slot_size}
    rows = [("AR greedy (base)", "base", {"name": "ar", **common})]
    if not args.no_own_ar:
        rows.append((OWN_AR, "refusion", {"name": "ar", **common}))
    rows += [(label(setting), "refusion", {**refusion, **setting}) for setting in settings]
    if ablate is not None:
        rows += [(label(ablate, **ablation), "refusion", {**refusion, **ablate, **ablation})
                 for ablation in ablations(ablate, slot_size, args.ablations)]
    return rows


def sweep_rows(args, slot_size: int) -> list[Row]:
    """The val sweep's rows: every (b, first token, tau) of the flags (the AR head's first token only at b = k)."""
    grid = [{"block_size": b, "threshold": tau, "first_token": first, "completion_drafts": args.completion_drafts}
            for b in args.block_sizes for first in args.first_tokens for tau in args.thresholds
            if first == "mask" or b == slot_size]
    if not grid:
        raise SystemExit(f"--first-tokens ar needs a block size equal to the slot size {slot_size} in --block-sizes")
    return phase_rows(args, grid, slot_size)


def report_rows(args, chosen: dict, slot_size: int) -> list[Row]:
    """The reported phase's rows (test, or ``--split``): the chosen setting at every tau of the sweep (the chosen
    tau alone with ``--test-chosen-only``) and its ablations."""
    taus = [chosen["threshold"]] if args.test_chosen_only else args.thresholds
    return phase_rows(args, [{**chosen, "threshold": t} for t in taus], slot_size, ablate=chosen)


def table_of(rows: list[Row], records: Records) -> list[dict]:
    """One table row per entry of ``rows`` from its (pooled) records, in order; the first is the base's AR
    greedy (the TPS ratios' and "= base AR greedy"'s reference), the checkpoint's own AR greedy (if run) the
    reference of "= own AR greedy"."""
    base_records, own_records = records[rows[0][0]], records.get(OWN_AR)
    table = []
    for name, _, decoder in rows:
        recs = records[name]
        m = compute_metrics(recs, decoder["name"] == "ar")
        slots = summarize_records(recs)["refusion_slots_per_step"] if decoder["name"] == "refusion" else None
        table.append({
            "decoder": name, "accuracy": m["accuracy"], "tpf": m["tpf"], "nfe_per_sample": m["nfe_per_sample"],
            "tps": m["tps"], "slots_per_step": slots, "num_samples": m["num_samples"], "config": decoder,
            "tps_ratio": m["tps"] / table[0]["tps"] if table else 1.0,
            "identical_to_base": identical(recs, base_records),
            "identical_to_own_ar": None if own_records is None else identical(recs, own_records)})
    return table


def chunk_fingerprint(args, rows: list[Row], split: str) -> dict:
    """What a phase's records are made by (pardec.benchmarks.chunks: a chunk of another setting is refused)."""
    return {"benchmark": "refusion", "base": args.base, "refusion": args.refusion, "split": split,
            "template": args.template, "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "rows": [[name, decoder] for name, _, decoder in rows]}  # the labels name the model


def choose_setting(val_table: list[dict], max_drop: float) -> tuple[dict, str]:
    """(the setting: block_size, threshold, first_token; the rule that chose it): the highest TPF
    within ``max_drop`` of the base's accuracy, or the most accurate setting (then the faster one) when
    none is within it."""
    base = val_table[0]["accuracy"]
    sweep = [r for r in val_table if r["decoder"].startswith("ReFusion")]
    ok = [r for r in sweep if r["accuracy"] >= base - max_drop - 1e-9]
    if ok:
        best, rule = max(ok, key=lambda r: r["tpf"]), f"the highest TPF within {max_drop:.0%} of the base's accuracy"
    else:
        best = max(sweep, key=lambda r: (r["accuracy"], r["tpf"]))
        rule = f"no setting is within {max_drop:.0%} of the base's accuracy: the most accurate one"
    return {key: best["config"][key] for key in SETTING_KEYS if key in best["config"]}, rule


def markdown(table: list[dict]) -> str:
    lines = ["| decoder | accuracy | = base AR greedy | = own AR greedy | TPF | NFE / sample | TPS | TPS / base AR "
             "| slots / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_base']:.1%} | "
        f"{or_dash(r['identical_to_own_ar'], '.1%')} | "
        f"{r['tpf']:.2f} | "
        f"{r['nfe_per_sample']:.1f} | {r['tps']:.1f} | {r['tps_ratio']:.2f}x | {or_dash(r['slots_per_step'], '.2f')} |"
        for r in table
    ]
    return "\n".join(lines)


def check_goals(test: list[dict], chosen: dict, slot_size: int, args) -> tuple[dict, str]:
    """(goal name -> met, one sentence per goal) on the test rows: TPF >= ``args.goal_tpf`` within
    ``args.goal_drop`` of the base's accuracy at some tau of the chosen setting (not an ablation);
    where recomputation was run, KV reuse >= ``args.goal_reuse`` x its TPS at accuracy within 1 point."""
    by_label = {r["decoder"]: r for r in test}
    ablated = {label(chosen, **a) for a in ablations(chosen, slot_size, args.ablations)}
    base = test[0]
    goals = {f"tpf_{args.goal_tpf:g}_within_{args.goal_drop:.0%}": any(
        r["tpf"] >= args.goal_tpf and r["accuracy"] >= base["accuracy"] - args.goal_drop - 1e-9
        for r in test if r["decoder"].startswith("ReFusion") and r["decoder"] not in ablated)}
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    text = (f"TPF >= {args.goal_tpf:g} within {args.goal_drop:.0%} of the base at some tau: "
            f"{met(next(iter(goals.values())))}")
    if "kv_reuse" in args.ablations:
        reuse, recompute = by_label[label(chosen)], by_label[label(chosen, kv_reuse=False)]
        ratio = reuse["tps"] / recompute["tps"]
        goals[f"kv_reuse_tps_{args.goal_reuse:g}x_recompute"] = ratio >= args.goal_reuse
        goals["kv_reuse_accuracy_within_1_point_of_recompute"] = (
            abs(reuse["accuracy"] - recompute["accuracy"]) <= 0.01 + 1e-9)
        text += (f"; KV reuse >= {args.goal_reuse:g}x the TPS of recomputation at {label(chosen)}: "
                 f"{met(ratio >= args.goal_reuse)} ({ratio:.2f}x), accuracy within 1 point of it: "
                 f"{met(goals['kv_reuse_accuracy_within_1_point_of_recompute'])}")
    return goals, text + "."


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {name: load_checkpoint(path, device=args.device, dtype=args.dtype)
              for name, path in (("base", args.base), ("refusion", args.refusion))}
    checkpoints = [args.base, args.refusion]

    slot_size = resolve_slot_size(models["refusion"][0], args.slot_size)
    val_rows = sweep_rows(args, slot_size)

    def sweep() -> list[dict]:
        records = decode_rows(models, validation_rows(args.num_val), val_rows, args.template, set())
        table = table_of(val_rows, records)
        for row in table:
            print(json.dumps(row), flush=True)
        return table

    # swept once per chunk directory: a restart chooses from the same table
    val, note = kept_in(args.chunk_dir, VALIDATION_FILE,
                        {**chunk_fingerprint(args, val_rows, "val"), "num_val": args.num_val}, sweep, checkpoints)
    kept_note = f", {note}" if note else ""
    chosen, rule = choose_setting(val, args.max_drop)
    test_rows = report_rows(args, chosen, slot_size)
    problems = split_rows(args.split, args.num_samples)
    command, warmed = invoked_command("pardec.benchmarks.refusion", argv), set()

    def write_table(records: Records, done: int, machine: Machine) -> None:
        test = table_of(test_rows, records)
        for row in test:
            print(json.dumps(row), flush=True)
        goals, goal_text = check_goals(test, chosen, slot_size, args)
        body = (
            f"Validation split ({args.num_val} problems of the generator's val split{kept_note}; setting chosen "
            f"here: {label(chosen)}, {rule}):\n\n{markdown(val)}\n\n"
            f"{split_label(args.split).capitalize()} ({done} problems"
            f"{progress_note(args.chunk_dir, args.chunk_size, done, len(problems))}):\n\n{markdown(test)}\n\n"
            f"Goals on the {split_label(args.split)}: {goal_text}"
        )
        print(f"Command: {command}\n\n{body}", flush=True)
        write_results(args.out, command, body, {
            "command": command, "chosen_block_size": chosen["block_size"], "chosen_threshold": chosen["threshold"],
            "chosen_first_token": chosen["first_token"], "chosen_label": label(chosen),
            "choice_rule": rule, "validation": val, "test": test, "goals": goals}, machine=machine)

    decode_all(problems, args.chunk_dir, args.chunk_size, chunk_fingerprint(args, test_rows, args.split),
               lambda subset, first: decode_rows(models, subset, test_rows, args.template, warmed, first),
               write_table, checkpoints)


if __name__ == "__main__":
    main()
