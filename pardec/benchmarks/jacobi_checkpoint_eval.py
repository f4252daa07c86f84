# python -m pardec.benchmarks.jacobi_checkpoint_eval --model runs/jacobi_forcing_default/stages/01-round2/hf \
#   --n 16 --mr --base-ar runs/base_ar_val.json
"""Quick evaluation of one Jacobi Forcing checkpoint while tuning a conversion (the
"How the defaults were chosen" rows of docs/results/jacobi_forcing.md): AR greedy accuracy, identity
with the base's AR greedy output, and Jacobi (and with ``--mr`` multi-block K=2, r=0.85, pool 4,
verify 4) TPF and identity at block sizes n and 2n, on the first ``--num`` problems of the validation
split (``--split val``, the default: where conversions are tuned) or of the test split, batch 1.
Prints one ``RESULT {json}`` line.

``--save-ar`` (run on the base) writes its AR greedy outputs; ``--base-ar`` reads them back.
The full side-by-side table with TPS is ``pardec/benchmarks/jacobi_forcing.py``.
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.common import add_split_arg, identical, split_rows
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.evaluate import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF export to evaluate")
    p.add_argument("--n", type=int, default=None, help="trained block size (Jacobi rows at n and 2n); none = AR only")
    p.add_argument("--num", type=int, default=200, help="problems")
    add_split_arg(p, default="val")  # tune on val; report on test
    p.add_argument("--base-ar", default=None, help="base AR greedy outputs (JSON from --save-ar)")
    p.add_argument("--save-ar", default=None, help="write this model's AR greedy outputs (JSON)")
    p.add_argument("--mr", action="store_true", help="also multi-block + rejection recycling")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    torch.set_num_threads(2)
    rows = split_rows(a.split, a.num)
    model, tok = load_checkpoint(a.model)
    common = {"max_new_tokens": 96, "batch_size": 1}
    out = {"tag": a.tag, "model": a.model, "split": a.split}
    ar = evaluate(model, tok, rows, {"name": "ar", **common}, agreement=False, shard=False)
    recs = sorted(ar.records, key=lambda r: r["index"])
    out["acc"] = ar.metrics["accuracy"]
    if a.save_ar:
        with open(a.save_ar, "w") as f:
            json.dump([r["output_ids"] for r in recs], f)
    if a.base_ar:
        with open(a.base_ar) as f:
            base = json.load(f)
        out["eq_base"] = sum(r["output_ids"] == b for r, b in zip(recs, base)) / len(recs)
    if a.n:
        decoders = [("jacobi", {"name": "jacobi"})]
        if a.mr:
            decoders.append(("mr", {"name": "multiblock", "num_blocks": 2, "spawn_ratio": 0.85,
                                    "ngram_pool_size": 4, "verification_size": 4}))
        for prefix, decoder in decoders:
            for n in sorted({a.n, 2 * a.n}):
                result = evaluate(model, tok, rows, {**decoder, "block_size": n, "draft_init": "context", **common},
                                  agreement=False, shard=False)
                out[f"{prefix}{n}_tpf"] = round(result.metrics["tpf"], 3)
                out[f"{prefix}{n}_id"] = identical(sorted(result.records, key=lambda r: r["index"]), recs)
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
