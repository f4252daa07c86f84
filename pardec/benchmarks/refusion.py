# python -m pardec.benchmarks.refusion --base runs/default_base/hf --refusion runs/refusion_default/hf
"""ReFusion on the embedded default: AR greedy of the base vs plan-and-infill over a sweep of (b, tau, first token).

One run, two phases, every row at batch 1 in this process after an untimed warm-up on two problems
(so TPS are comparable; TPS ratios are to the base's AR greedy of the same phase):

1. **Tuning on the validation split** (``--num-val`` problems of the generator's ``val`` split,
   disjoint from train and test): AR greedy of the base and of the ReFusion checkpoint itself, then
   ReFusion (KV reuse) at every semi-AR block size b of ``--block-sizes``, every threshold tau of
   ``--thresholds`` (tau sets both the plan and the verify threshold) and every source of a slot's
   first token of ``--first-tokens`` (``mask``: the paper's plan; ``ar``: the AR head, only at b = k).
   The chosen setting is the one with the highest TPF whose validation accuracy is within
   ``--max-drop`` points of the base's (the most accurate one when none is).
2. **Test** (the first ``--num-samples`` held-out test problems): the two AR greedy rows, ReFusion at
   the chosen b and first-token source and every tau of the sweep with KV reuse, and the chosen
   setting again with ``kv_reuse=false`` (the whole context recomputed every forward, the paper's
   ablation), with ``fuse_plan=false`` (a plan forward every step: the same tokens, more forwards)
   and, at b = k, with the other first-token source.

Columns: accuracy (exact ``#### n``); = base AR greedy (share of samples whose output tokens equal the
base's AR greedy output exactly); TPF = committed tokens / decoding forwards and NFE per sample
(docs/methods/conventions.md#counting: prefill excluded, nothing after EOS); TPS and TPS / base AR; slots / step
= slots
accepted per plan-and-infill iteration. Slot size k: the checkpoint's ``pardec.slot_size`` unless
``--slot-size``. With b = k every step completes one slot. Its first token comes from the plan (the
mask head) with ``first_token=mask``, so that is not lossless with respect to the checkpoint's own AR
greedy; with ``first_token=ar`` and tau >= 0.5 it is (``pardec.inference.decoders.refusion``).

Writes ``benchmarks/results/refusion.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pardec.benchmarks.common import RESULTS, held_out_rows, identical, invoked_command, validation_rows, write_results
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.refusion import resolve_slot_size
from pardec.inference.evaluate import evaluate

OWN_AR = "AR greedy (ReFusion checkpoint)"
SETTING_KEYS = ("block_size", "threshold", "first_token")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--refusion", required=True, help="ReFusion export (recipe=refusion)")
    p.add_argument("--num-samples", type=int, default=200, help="test problems")
    p.add_argument("--num-val", type=int, default=200, help="validation problems (tuning)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    p.add_argument("--max-drop", type=float, default=0.02, help="accuracy drop tolerated when choosing (b, tau)")
    p.add_argument("--slot-size", type=int, default=None, help="default: the checkpoint's pardec.slot_size")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16],
                   help="semi-AR block sizes b swept on validation (multiples of the slot size)")
    p.add_argument("--first-tokens", nargs="+", default=["mask", "ar"], choices=["mask", "ar"],
                   help="sources of a slot's first token swept on validation (ar only where b = k)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "refusion"))
    return p.parse_args()


def run_row(label: str, model, tok, rows, decoder: dict) -> dict:
    warmup = rows.select(range(min(2, len(rows))))
    evaluate(model, tok, warmup, decoder, agreement=False, shard=False)  # untimed warm-up
    result = evaluate(model, tok, rows, decoder, agreement=False, shard=False, progress=True)
    m = result.metrics
    row = {"decoder": label, "accuracy": m["accuracy"], "tpf": m["tpf"], "nfe_per_sample": m["nfe_per_sample"],
           "tps": m["tps"], "slots_per_step": m.get("refusion_slots_per_step"), "config": decoder}
    print(json.dumps(row), flush=True)
    return row, sorted(result.records, key=lambda r: r["index"])


def ablations(setting: dict, slot_size: int) -> list[dict]:
    """The test phase's variants of the chosen setting: recomputation, a plan forward every step and,
    at b = k, the other first-token source."""
    out = [{"kv_reuse": False}, {"fuse_plan": False}]
    if setting["block_size"] == slot_size:
        out.append({"first_token": "mask" if setting["first_token"] == "ar" else "ar"})
    return out


def label(setting: dict, **ablation) -> str:
    """``setting``: block_size, threshold, first_token; ``ablation``: overrides, named after them."""
    first = ablation.pop("first_token", None)
    text = f"ReFusion b={setting['block_size']} tau={setting['threshold']:g}"
    text += f" first_token={first or setting['first_token']}"
    return text + "".join(f", {k}={str(v).lower()}" for k, v in ablation.items())


def phase(args, models, rows, settings: list[dict], slot_size: int, ablate: dict | None = None) -> list[dict]:
    """AR greedy of the base and of the ReFusion checkpoint, then ReFusion at every setting of
    ``settings``, and at ``ablate`` once per entry of :func:`ablations`."""
    common = {"max_new_tokens": args.max_new_tokens, "batch_size": 1}
    refusion = {"name": "refusion", **common, "slot_size": args.slot_size}
    runs = [run_row("AR greedy (base)", *models["base"], rows, {"name": "ar", **common}),
            run_row(OWN_AR, *models["refusion"], rows, {"name": "ar", **common})]
    for setting in settings:
        runs.append(run_row(label(setting), *models["refusion"], rows, {**refusion, **setting}))
    if ablate is not None:
        for ablation in ablations(ablate, slot_size):
            runs.append(run_row(label(ablate, **ablation), *models["refusion"], rows,
                                {**refusion, **ablate, **ablation}))
    (base, base_records), (_, own_records), table = runs[0], runs[1], [row for row, _ in runs]
    for row, records in runs:
        row["tps_ratio"] = row["tps"] / base["tps"]
        row["identical_to_base"] = identical(records, base_records)
        row["identical_to_own_ar"] = identical(records, own_records)
    return table


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
    return {key: best["config"][key] for key in SETTING_KEYS}, rule


def markdown(table: list[dict]) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)
    lines = ["| decoder | accuracy | = base AR greedy | = own AR greedy | TPF | NFE / sample | TPS | TPS / base AR "
             "| slots / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_base']:.1%} | {r['identical_to_own_ar']:.1%} | "
        f"{r['tpf']:.2f} | "
        f"{r['nfe_per_sample']:.1f} | {r['tps']:.1f} | {r['tps_ratio']:.2f}x | {fmt(r['slots_per_step'], '.2f')} |"
        for r in table
    ]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    models = {"base": load_checkpoint(args.base, device="cpu"),
              "refusion": load_checkpoint(args.refusion, device="cpu")}

    slot_size = resolve_slot_size(models["refusion"][0], args.slot_size)
    grid = [{"block_size": b, "threshold": tau, "first_token": first}
            for b in args.block_sizes for first in args.first_tokens for tau in args.thresholds
            if first == "mask" or b == slot_size]
    if not grid:
        raise SystemExit(f"--first-tokens ar needs a block size equal to the slot size {slot_size} in --block-sizes")
    val = phase(args, models, validation_rows(args.num_val), grid, slot_size)
    chosen, rule = choose_setting(val, args.max_drop)
    block, tau = chosen["block_size"], chosen["threshold"]
    test = phase(args, models, held_out_rows(args.num_samples), [{**chosen, "threshold": t} for t in args.thresholds],
                 slot_size, ablate=chosen)

    by_label = {r["decoder"]: r for r in test}
    reuse, recompute = by_label[label(chosen)], by_label[label(chosen, kv_reuse=False)]
    ablated = {label(chosen, **a) for a in ablations(chosen, slot_size)}
    base = test[0]
    goals = {
        "tpf_2.5_within_2_points": any(
            r["tpf"] >= 2.5 and r["accuracy"] >= base["accuracy"] - 0.02 - 1e-9
            for r in test if r["decoder"].startswith("ReFusion") and r["decoder"] not in ablated),
        "kv_reuse_tps_1.5x_recompute": reuse["tps"] >= 1.5 * recompute["tps"],
        "kv_reuse_accuracy_within_1_point_of_recompute": abs(reuse["accuracy"] - recompute["accuracy"]) <= 0.01 + 1e-9,
    }
    command = invoked_command("pardec.benchmarks.refusion")
    body = (
        f"Validation split ({args.num_val} problems of the generator's val split; setting chosen here: "
        f"{label(chosen)}, {rule}):\n\n{markdown(val)}\n\n"
        f"Test split ({args.num_samples} held-out problems):\n\n{markdown(test)}\n\n"
        f"Goals on the test split: TPF >= 2.5 within 2 points of the base at some tau: "
        f"{'met' if goals['tpf_2.5_within_2_points'] else 'NOT met'}; KV reuse >= 1.5x the TPS of recomputation "
        f"at {label(chosen)}: {'met' if goals['kv_reuse_tps_1.5x_recompute'] else 'NOT met'} "
        f"({reuse['tps'] / recompute['tps']:.2f}x), accuracy within 1 point of it: "
        f"{'met' if goals['kv_reuse_accuracy_within_1_point_of_recompute'] else 'NOT met'}."
    )
    print(f"Command: {command}\n\n{body}")
    write_results(args.out, command, body, {
        "command": command, "chosen_block_size": block, "chosen_threshold": tau,
        "chosen_first_token": chosen["first_token"], "chosen_label": label(chosen),
        "choice_rule": rule, "validation": val, "test": test, "goals": goals})


if __name__ == "__main__":
    main()
