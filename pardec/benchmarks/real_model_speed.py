# python -m pardec.benchmarks.real_model_speed --model models/smollm2-135m-instruct
"""How a real model's decoding time scales with the number of tokens a forward computes.

On a CPU (as for a 7B model decoding on a GPU) a forward is bound by reading the weights: q
parallel query tokens cost far less than q sequential forwards, so a parallel decoder's TPF turns
into TPS up to the bound TPF * t(1) / t(q). Two tables, in one process:

1. forward latency of q new tokens (q = 1 ... 64) after a ``--cache``-token KV cache, at each of
   ``--threads``: median of ``--repeats`` timed forwards after two untimed ones, and t(q) / t(1);
2. decoding on the first ``--num-samples`` test problems, rendered through the chat template
   (batch 1, one sample at a time, after an untimed warm-up on two problems): AR greedy and the
   untrained model's vanilla Jacobi decoding (block n), with accuracy, TPF, TPS, TPS / AR, and
   for Jacobi the bound TPF * t(1) / t(n) from table 1 and the share of it reached. A model
   never trained for Jacobi decoding converges about one token per iteration (the papers report
   TPF 1.03-1.05): a sanity row, not a result.

Writes ``<out>.{md,json}`` (default ``benchmarks/results/real/cpu_speed``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from pardec.benchmarks.common import RESULTS, held_out_rows, identical, invoked_command, or_dash, write_results
from pardec.common.kv_cache import cache_argument, crop_cache
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.evaluate import evaluate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", required=True, help="HF checkpoint directory (e.g. a pardec-import output)")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cache", type=int, default=256, help="KV cache length before the timed forward")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--num-samples", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="Jacobi block n")
    p.add_argument("--decode-threads", type=int, default=1, help="threads for the decoding table")
    p.add_argument("--out", default=str(RESULTS / "real" / "cpu_speed"))
    return p.parse_args(argv)


def forward_latencies(model, widths: list[int], cache_len: int, repeats: int) -> dict[int, float]:
    """Median seconds of one forward of each of ``widths`` new tokens after a ``cache_len``-token cache.

    The widths are measured in turn, ``repeats`` rounds after two warm-up rounds, so a slow spell of
    the machine lands on every width alike instead of on whichever width was being measured then:
    measured one width after the other, t(7) / t(1) once came out at 2.28 in a run whose own decoding
    spent only 1.64 times an AR step per 7-token forward (docs/results/real_cpu.md)."""
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    generator = torch.Generator().manual_seed(cache_len)
    times: dict[int, list[float]] = {width: [] for width in widths}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, vocab, (1, cache_len), generator=generator).to(device),
              **cache_argument(cache), use_cache=True)
        for i in range(repeats + 2):
            for width in widths:
                ids = torch.randint(0, vocab, (1, width), generator=generator).to(device)
                positions = torch.arange(cache_len, cache_len + width, device=device).unsqueeze(0)
                start = time.perf_counter()
                logits = model(input_ids=ids, position_ids=positions, **cache_argument(cache), use_cache=True).logits
                logits[0].argmax(-1).tolist()  # the decoders read the argmax back: part of a step
                if i >= 2:
                    times[width].append(time.perf_counter() - start)
                crop_cache(cache, cache_len)
    return {width: statistics.median(t) for width, t in times.items()}


def latency_table(model, args) -> list[dict]:
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        seconds = forward_latencies(model, args.widths, args.cache, args.repeats)
        for width in args.widths:
            rows.append({"threads": threads, "query_tokens": width, "ms": 1000 * seconds[width],
                         "ratio_to_1": seconds[width] / seconds[1] if 1 in seconds else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decoding_table(model, tokenizer, args, latency: list[dict]) -> list[dict]:
    torch.set_num_threads(args.decode_threads)
    rows_in = held_out_rows(args.num_samples)
    warmup = rows_in.select(range(min(2, len(rows_in))))
    t = {(r["threads"], r["query_tokens"]): r["ms"] for r in latency}
    n = args.block_size
    decoders = [("AR greedy", {"name": "ar"}, 1), (f"Jacobi n={n} (untrained)", {"name": "jacobi", "block_size": n}, n)]
    table, ar_records = [], None
    for label, decoder, width in decoders:
        cfg = {**decoder, "max_new_tokens": args.max_new_tokens, "batch_size": 1}
        evaluate(model, tokenizer, warmup, cfg, template="chat", agreement=False, shard=False)
        result = evaluate(model, tokenizer, rows_in, cfg, template="chat", agreement=False, shard=False, progress=True)
        m, records = result.metrics, sorted(result.records, key=lambda r: r["index"])
        ar_records = records if ar_records is None else ar_records
        ratio = m["tps"] / table[0]["tps"] if table else 1.0
        key = (args.decode_threads, width)
        bound = m["tpf"] * t[(args.decode_threads, 1)] / t[key] if key in t and width > 1 else None
        table.append({"decoder": label, "accuracy": m["accuracy"], "accuracy_flexible": m["accuracy_flexible"],
                      "identical_to_ar": identical(records, ar_records), "tpf": m["tpf"], "tps": m["tps"],
                      "tps_ratio": ratio, "bound": bound, "share_of_bound": ratio / bound if bound else None,
                      "mean_new_tokens": m["mean_new_tokens"]})
        print(json.dumps(table[-1]), flush=True)
    return table


def render(latency: list[dict], decoding: list[dict], args) -> str:
    widths = args.widths
    lines = [f"fp32, KV cache of {args.cache} tokens.", "",
             "Forward latency (ms, median of the timed forwards) against query tokens q, and t(q) / t(1):", "",
             "| threads | " + " | ".join(f"q={w}" for w in widths) + " |",
             "|---|" + "---|" * len(widths)]
    for threads in args.threads:
        cells = [r for r in latency if r["threads"] == threads]
        lines.append(f"| {threads} | " + " | ".join(f"{r['ms']:.1f} ({r['ratio_to_1']:.2f}x)" for r in cells) + " |")
    lines += ["", f"Decoding, {args.num_samples} test problems, chat template, batch 1, "
                  f"{args.decode_threads} thread(s):",
              "", "| decoder | accuracy | flexible accuracy | = AR greedy | TPF | TPS | TPS / AR | bound TPF·t(1)/t(n) "
              "| share of bound | new tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['decoder']} | {r['accuracy']:.1%} | {r['accuracy_flexible']:.1%} | {r['identical_to_ar']:.1%} | "
              f"{r['tpf']:.3f} | {r['tps']:.1f} | {r['tps_ratio']:.2f}x | {or_dash(r['bound'], '.2f')} | "
              f"{or_dash(r['share_of_bound'], '.0%')} | {r['mean_new_tokens']:.1f} |" for r in decoding]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = load_checkpoint(args.model, device="cpu")
    model.eval()
    latency = latency_table(model, args)
    decoding = decoding_table(model, tokenizer, args, latency)
    md = render(latency, decoding, args)
    print(md)
    write_results(args.out, invoked_command("pardec.benchmarks.real_model_speed"), md,
                  {"latency": latency, "decoding": decoding, "model": args.model})


if __name__ == "__main__":
    main()
