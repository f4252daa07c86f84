# python -m pardec.benchmarks.decoder_eval --model runs/refusion_default/hf --num 100 \
#   --decoder '{"name": "refusion", "block_size": 8, "threshold": 0.5}' --decoder '{"name": "ar"}'
"""Quick accuracy and TPF of one checkpoint under one or more decoders, for tuning a conversion or
a decoder setting (the "how it was chosen" rows of docs/results/): the first ``--num`` problems of the
validation split (``--split val``, the default: where settings are tuned) or of the test split,
batch 1, ``--max-new-tokens`` 64 unless a decoder sets it, one thread. Prints one line per decoder:
its JSON, accuracy, TPF, TPS and the decoder's per-step statistics; with ``--stats`` also the
per-sample mean of every numeric entry of the decoders' ``DecodeResult.stats`` (e.g. COVER's
remasks, replaces and capped remasks). The side-by-side tables (TPS against AR greedy, the goals)
are the method benchmarks.
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.common import add_split_arg, split_rows
from pardec.common.errors import ConfigError
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.evaluate import evaluate


def decoder_configs(specs: list[str], max_new_tokens: int) -> list[dict]:
    """``--decoder`` JSON objects -> decoder configs (batch 1, ``max_new_tokens`` unless given)."""
    configs = []
    for spec in specs:
        try:
            cfg = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--decoder {spec!r} is not JSON: {err}") from None
        if not isinstance(cfg, dict) or "name" not in cfg:
            raise ConfigError(f"--decoder {spec!r} must be a JSON object with a 'name' (a decoder of the registry)")
        configs.append({"batch_size": 1, "max_new_tokens": max_new_tokens, **cfg})
    return configs


def mean_stats(records: list[dict]) -> dict[str, float]:
    """Per-sample mean of every numeric (not boolean) entry of the records' ``stats``; an entry a
    record lacks counts as 0 for it."""
    keys = sorted({k for r in records for k, v in r["stats"].items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: sum(r["stats"].get(k, 0) for r in records) / len(records) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF export to evaluate")
    p.add_argument("--decoder", action="append", required=True, help="decoder config as JSON (repeatable)")
    p.add_argument("--num", type=int, default=100, help="problems")
    add_split_arg(p, default="val")  # tune on val; report on test
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stats", action="store_true", help="also print the per-sample mean of each numeric stat")
    a = p.parse_args()
    configs = decoder_configs(a.decoder, a.max_new_tokens)
    torch.set_num_threads(1)
    rows = split_rows(a.split, a.num)
    model, tok = load_checkpoint(a.model, device="cpu")
    for cfg in configs:
        result = evaluate(model, tok, rows, cfg, agreement=False, shard=False)
        m = result.metrics
        per_step = {k: round(v, 3) for k, v in m.items() if k.endswith("per_step") and v is not None}
        print(json.dumps(cfg), f"accuracy {m['accuracy']:.1%} tpf {m['tpf']:.3f} tps {m['tps']:.0f}", per_step,
              flush=True)
        if a.stats:
            print("  per-sample means:", {k: round(v, 3) for k, v in mean_stats(result.records).items()}, flush=True)


if __name__ == "__main__":
    main()
