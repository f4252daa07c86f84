# python -m pardec.benchmarks.idlm_isd --base runs/default_base/hf --idlm runs/idlm_default/stages/02-stride4/hf \
#   --risd runs/idlm_lora_default/hf
"""I-DLM on the embedded default: AR greedy vs ISD (N = 2, 3, 4; greedy and sampling) vs R-ISD.

All rows decode the same held-out problems one sample at a time (batch 1) in one process, one
after the other, each after an untimed warm-up on two problems, so their TPS are comparable; TPS
ratios are to AR greedy of the base measured in this run. Columns:

* accuracy: exact final answer (``#### n``);
* = base: fraction of samples whose tokens equal the base model's AR greedy output exactly;
* TPF = committed tokens / decoding forwards (docs/methods/conventions.md#counting), TPS and its ratio to base
  AR greedy;
* alpha: introspective acceptance rate of the row's model at the row's stride, over the tokens it
  generated (arXiv:2604.11035 §2);
* TPF formula: the paper's (2 + P_1 + ... + P_{N-2}) / (2 - P_{N-1}) on the measured acceptance.

A real chat model (``--template auto`` renders its prompts through the chat template) runs the same
way, on any ``--device`` and ``--dtype``; ``--strides`` and ``--no-sample`` choose the ISD rows and
``--split val`` the validation problems. ``--num-val K`` chooses N on validation first: AR greedy of
both models and greedy ISD at every N of ``--strides`` on the first K val problems, N = the highest
TPS among the greedy rows identical to the checkpoint's own AR greedy (on a CPU a wider verify forward
costs more, so the highest TPF need not be the fastest); the ``--split`` rows then have ISD at that N
alone, or also at the N of ``--test-strides`` (a goal stated at a fixed N, answered whichever N val
chooses), and the JSON is ``{chosen_stride, choice_rule, test_strides, validation, test}`` instead of
the table.
``--cuda-graphs`` runs every row, AR included, over a static cache with each step width captured once
as a CUDA graph (``pardec.inference.decoders.decode_steps``), so that on a GPU TPS follows TPF.

Bound: where a forward of q tokens costs more than one of 1 (a CPU, the real model), a verify step
of stride N feeds 2N-1 tokens, so a decoder committing TPF tokens per forward reaches at most
TPF · t(1) / t(2N-1) times AR's TPS. ``t`` is measured on the base model in this run (median of
``--bound-repeats`` forwards after a ``--bound-cache``-token KV cache, the widths measured in turn, as
``pardec.benchmarks.real_model_speed``) and each ISD row shows its bound and the share of it that its
TPS / AR reaches (``--no-bound`` skips it). Writes ``<out>.{md,json}`` (default
``benchmarks/results/idlm_isd``).
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.common import (
    RESULTS,
    add_bound_args,
    add_runtime_args,
    add_split_arg,
    fastest_lossless,
    identical,
    invoked_command,
    or_dash,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.benchmarks.real_model_speed import forward_latencies
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.isd import introspective_ratios, resolve_stride
from pardec.inference.evaluate import encode_prompt, evaluate
from pardec.models.loading import mask_token_id


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--idlm", default=None, help="I-DLM export (recipe=idlm); without it only AR and R-ISD rows")
    p.add_argument("--risd", default=None, help="gated-LoRA export (recipe=idlm_lora)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    add_split_arg(p)
    p.add_argument("--strides", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--num-val", type=int, default=0,
                   help="choose N among --strides on this many val problems first (highest TPS, lossless)")
    p.add_argument("--test-strides", type=int, nargs="+", default=[],
                   help="with --num-val: greedy ISD also at these N on the --split rows, beside the N chosen on val")
    p.add_argument("--no-sample", action="store_true", help="greedy ISD rows only")
    add_runtime_args(p)
    add_bound_args(p, "2N-1")
    p.add_argument("--out", default=str(RESULTS / "idlm_isd"))
    return p.parse_args(argv)


def alpha(model, tokenizer, records, stride: int, template: str) -> float:
    mask_id = mask_token_id(model, tokenizer)
    ratios = []
    with torch.no_grad():
        for r in records:
            prompt = encode_prompt(tokenizer, r["prompt"], template, False, r["index"])
            if len(r["output_ids"]) >= 2:
                ratios.append(introspective_ratios(model, prompt, r["output_ids"], mask_id, stride))
    return float(torch.cat(ratios).mean()) if ratios else float("nan")


def measure(args, models, eval_rows, rows, latency) -> list[dict]:
    """One table row per ``(label, model key, decoder config, stride)`` of ``rows`` on ``eval_rows``, in
    order (the first is the base's AR greedy: the TPS ratios' reference)."""
    table, own_ar = [], {}
    warmup = eval_rows.select(range(min(2, len(eval_rows))))
    for label, which, decoder, stride in rows:
        model, tok = models[which]
        # Untimed warm-up: first-call allocations would otherwise slow the first row down.
        evaluate(model, tok, warmup, decoder, template=args.template, agreement=False, shard=False)
        result = evaluate(model, tok, eval_rows, decoder, template=args.template, agreement=False, shard=False,
                          progress=True)
        m, recs = result.metrics, sorted(result.records, key=lambda r: r["index"])
        if decoder["name"] == "ar":
            own_ar[which] = recs
        # R-ISD's clean stream is the frozen base: its own AR greedy is the base's.
        own = own_ar["base" if which == "risd" else which]
        row = {
            "decoder": label, "accuracy": m["accuracy"],
            "identical_to_base": identical(recs, own_ar["base"]), "identical_to_own_ar": identical(recs, own),
            "stride": stride, "greedy": decoder.get("mode", "greedy") == "greedy",
            "tpf": m["tpf"], "num_samples": m["num_samples"],
            "tps": m["tps"], "tps_ratio": m["tps"] / table[0]["tps"] if table else 1.0,
            "alpha": alpha(model, tok, recs, stride, args.template) if stride else None,
            "tpf_formula": m.get("isd_tpf_predicted"),
            "bound": m["tpf"] * latency[1] / latency[2 * stride - 1] if stride and latency else None,
            "t_verify_over_t_1": latency[2 * stride - 1] / latency[1] if stride and latency else None,
        }
        row["share_of_bound"] = row["tps_ratio"] / row["bound"] if row["bound"] else None
        table.append(row)
        print(json.dumps(row), flush=True)
    return table


def choose_stride(val_table: list[dict]) -> tuple[int, str]:
    """(N, the rule that chose it): the fastest greedy ISD row identical to own AR greedy on val
    (:func:`pardec.benchmarks.common.fastest_lossless`)."""
    best, rule = fastest_lossless([r for r in val_table if r["stride"] and r["greedy"]], "greedy rows")
    return best["stride"], rule


def markdown(table: list[dict]) -> str:
    header = ("| decoder | accuracy | = base AR greedy | = own AR greedy | TPF | TPS | TPS / AR | alpha | TPF formula "
              "| bound TPF·t(1)/t(2N-1) | share of bound |\n|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([header] + [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_base']:.1%} | {r['identical_to_own_ar']:.1%} | "
        f"{r['tpf']:.2f} | {r['tps']:.1f} | "
        f"{r['tps_ratio']:.2f}x | {or_dash(r['alpha'], '.3f')} | {or_dash(r['tpf_formula'], '.2f')} | "
        f"{or_dash(r['bound'], '.2f')} | {or_dash(r['share_of_bound'], '.0%')} |"
        for r in table
    ])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.idlm is None and args.risd is None:
        raise SystemExit("give --idlm, --risd or both: there is nothing to compare AR greedy with")
    if args.num_val and args.idlm is None:
        raise SystemExit("--num-val chooses the I-DLM checkpoint's N: give --idlm")
    if args.num_val and args.split == "val":
        raise SystemExit("--num-val chooses N on val to report on test: drop --split val")
    if args.test_strides and not args.num_val:
        raise SystemExit("--test-strides adds test rows beside the N chosen on val: give --num-val "
                         "(without it the test rows decode every N of --strides)")
    eval_rows = split_rows(args.split, args.num_samples)

    def load(path: str):
        return load_checkpoint(path, device=args.device, dtype=args.dtype)

    models = {"base": load(args.base)}
    if args.idlm:
        models["idlm"] = load(args.idlm)
    if args.risd:
        models["risd"] = load(args.risd)

    greedy = {"max_new_tokens": args.max_new_tokens, "batch_size": 1, "cuda_graphs": args.cuda_graphs}
    sample = {**greedy, "mode": "sample", "temperature": args.temperature}

    def isd_rows(strides: list[int], sampled: bool) -> list[tuple]:
        return [
            ("AR greedy (I-DLM ckpt)", "idlm", {"name": "ar", **greedy}, None),
            *[(f"ISD N={n} greedy", "idlm", {"name": "isd", "stride": n, **greedy}, n) for n in strides],
            *[(f"ISD N={n} sample T={args.temperature}", "idlm", {"name": "isd", "stride": n, **sample}, n)
              for n in (strides if sampled else [])],
        ]

    base_ar = ("AR greedy (base)", "base", {"name": "ar", **greedy}, None)
    risd_stride = resolve_stride(models["risd"][0], None) if args.risd else None
    strides = sorted({*(args.strides if args.idlm else []), *args.test_strides,
                      *([risd_stride] if risd_stride else [])})
    latency = {} if args.no_bound else forward_latencies(
        models["base"][0], [1, *(2 * n - 1 for n in strides)], args.bound_cache, args.bound_repeats)

    validation, chosen, rule = None, None, None
    test_strides = args.strides
    if args.num_val:
        validation = measure(args, models, validation_rows(args.num_val), [base_ar, *isd_rows(args.strides, False)],
                             latency)
        chosen, rule = choose_stride(validation)
        test_strides = sorted({chosen, *args.test_strides})
    rows = [base_ar, *(isd_rows(test_strides, not args.no_sample) if args.idlm else [])]
    if args.risd:
        rows.append((f"R-ISD N={risd_stride} greedy (gated LoRA)", "risd",
                     {"name": "isd", "stride": risd_stride, **greedy}, risd_stride))
    table = measure(args, models, eval_rows, rows, latency)

    command = invoked_command("pardec.benchmarks.idlm_isd")
    if validation is None:
        md, payload = markdown(table), table
    else:
        md = (f"Validation split ({args.num_val} problems of the generator's val split; N chosen here: {chosen}, "
              f"{rule}):\n\n{markdown(validation)}\n\n"
              f"{split_label(args.split).capitalize()} ({args.num_samples} problems; ISD at N = "
              f"{', '.join(map(str, test_strides))}):\n\n{markdown(table)}")
        payload = {"command": command, "chosen_stride": chosen, "choice_rule": rule,
                   "test_strides": test_strides, "validation": validation, "test": table}
    print(md)
    write_results(args.out, command, md, payload)


if __name__ == "__main__":
    main()
