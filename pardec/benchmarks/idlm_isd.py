# python -m pardec.benchmarks.idlm_isd --base runs/default_base/hf --idlm runs/idlm_default/stages/02-stride4/hf --risd runs/idlm_lora_default/hf
"""I-DLM on the embedded default: AR greedy vs ISD (N = 2, 3, 4; greedy and sampling) vs R-ISD.

All rows decode the same held-out problems one sample at a time (batch 1) in one process, one
after the other, each after an untimed warm-up on two problems, so their TPS are comparable; TPS ratios are to AR greedy of the base measured in
this run. Columns:

* accuracy: exact final answer (``#### n``);
* = base: fraction of samples whose tokens equal the base model's AR greedy output exactly;
* TPF = committed tokens / decoding forwards (docs/methods/conventions.md#counting), TPS and its ratio to base
  AR greedy;
* alpha: introspective acceptance rate of the row's model at the row's stride, over the tokens it
  generated (arXiv:2604.11035 §2);
* TPF formula: the paper's (2 + P_1 + ... + P_{N-2}) / (2 - P_{N-1}) on the measured acceptance.

Writes ``benchmarks/results/idlm_isd.{md,json}``.
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.common import RESULTS, held_out_rows, identical, invoked_command, write_results
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.isd import introspective_ratios, resolve_stride
from pardec.inference.evaluate import evaluate
from pardec.models.loading import mask_token_id



def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--idlm", required=True, help="I-DLM export (recipe=idlm)")
    p.add_argument("--risd", default=None, help="gated-LoRA export (recipe=idlm_lora)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "idlm_isd"))
    return p.parse_args()


def alpha(model, tokenizer, records, stride: int) -> float:
    mask_id = mask_token_id(model, tokenizer)
    ratios = []
    with torch.no_grad():
        for r in records:
            prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
            if len(r["output_ids"]) >= 2:
                ratios.append(introspective_ratios(model, prompt, r["output_ids"], mask_id, stride))
    return float(torch.cat(ratios).mean()) if ratios else float("nan")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    eval_rows = held_out_rows(args.num_samples)

    base, base_tok = load_checkpoint(args.base, device="cpu")
    idlm, idlm_tok = load_checkpoint(args.idlm, device="cpu")
    models = {"base": (base, base_tok), "idlm": (idlm, idlm_tok)}
    if args.risd:
        models["risd"] = load_checkpoint(args.risd, device="cpu")

    greedy = {"max_new_tokens": args.max_new_tokens, "batch_size": 1}
    sample = {**greedy, "mode": "sample", "temperature": args.temperature}
    rows = [
        ("AR greedy (base)", "base", {"name": "ar", **greedy}, None),
        ("AR greedy (I-DLM ckpt)", "idlm", {"name": "ar", **greedy}, None),
        *[(f"ISD N={n} greedy", "idlm", {"name": "isd", "stride": n, **greedy}, n) for n in (2, 3, 4)],
        *[(f"ISD N={n} sample T={args.temperature}", "idlm", {"name": "isd", "stride": n, **sample}, n) for n in (2, 3, 4)],
    ]
    if args.risd:
        stride = resolve_stride(models["risd"][0], None)
        rows.append((f"R-ISD N={stride} greedy (gated LoRA)", "risd", {"name": "isd", "stride": stride, **greedy}, stride))

    table, own_ar = [], {}
    warmup = eval_rows.select(range(min(2, len(eval_rows))))
    for label, which, decoder, stride in rows:
        model, tok = models[which]
        # Untimed warm-up: first-call allocations would otherwise slow the first row down.
        evaluate(model, tok, warmup, decoder, agreement=False, shard=False)
        result = evaluate(model, tok, eval_rows, decoder, agreement=False, shard=False, progress=True)
        m, recs = result.metrics, sorted(result.records, key=lambda r: r["index"])
        if decoder["name"] == "ar":
            own_ar[which] = recs
        # R-ISD's clean stream is the frozen base: its own AR greedy is the base's.
        own = own_ar["base" if which == "risd" else which]
        row = {
            "decoder": label, "accuracy": m["accuracy"],
            "identical_to_base": identical(recs, own_ar["base"]), "identical_to_own_ar": identical(recs, own),
            "tpf": m["tpf"],
            "tps": m["tps"], "tps_ratio": m["tps"] / table[0]["tps"] if table else 1.0,
            "alpha": alpha(model, tok, recs, stride) if stride else None,
            "tpf_formula": m.get("isd_tpf_predicted"),
        }
        table.append(row)
        print(json.dumps(row), flush=True)

    header = ("| decoder | accuracy | = base AR greedy | = own AR greedy | TPF | TPS | TPS / AR | alpha | TPF formula |\n"
              "|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [header] + [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_base']:.1%} | {r['identical_to_own_ar']:.1%} | "
        f"{r['tpf']:.2f} | {r['tps']:.1f} | "
        f"{r['tps_ratio']:.2f}x | {fmt(r['alpha'], '.3f')} | {fmt(r['tpf_formula'], '.2f')} |"
        for r in table
    ]
    md = "\n".join(lines)
    print(md)
    write_results(args.out, invoked_command("pardec.benchmarks.idlm_isd"), md, table)


if __name__ == "__main__":
    main()
