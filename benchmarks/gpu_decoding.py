# python -m benchmarks.gpu_decoding --base runs/default_base/hf --idlm runs/idlm_default/stages/03-stride4_more/hf --risd runs/idlm_lora_default/hf --jacobi runs/jacobi_forcing_default/stages/01-round2/hf   (needs a CUDA GPU)
"""Parallel decoding on GPU: forward latency against parallel query tokens, and TPS / AR greedy.

Two tables, one run, bf16, batch 1:

1. ``latency``: a randomly initialised model of Qwen2.5-0.5B shape (SDPA) holds a KV cache of
   ``--cache`` tokens; one forward of q new tokens (q = 1 ... 512) is timed (median of
   ``--repeats`` after warm-up, the cache cropped back after each). The cost of a parallel decoder's
   forward relative to an AR step is ``ms(q) / ms(1)``. One q = 1 forward is also profiled: the
   GPU's busy time against the wall time says how much of an AR step is launch and Python overhead.
2. ``decoding``: the embedded default's converted checkpoints decode the same held-out problems with
   AR greedy, ISD N=4 (I-DLM), R-ISD (gated LoRA), Jacobi and multi-block (Jacobi Forcing round 2),
   each after an untimed warm-up. TPS / AR is against the base's AR greedy in this run, and
   ``(TPS / AR) / TPF`` is the fraction of the forward saving that reaches wall time; ``ms / forward``
   against AR's says why it falls short.

Writes ``benchmarks/results/gpu_decoding_{latency,decoding}.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks.common import held_out_rows, identical
from benchmarks.mask_backends import VOCAB, gpu_busy_ms, qwen25_05b_shape
from inference.checkpoint import load_checkpoint
from inference.decoders.base import synchronize
from inference.decoders.isd import resolve_stride
from inference.decoders.jacobi import resolve_block_size
from inference.evaluate import evaluate

RESULTS = Path(__file__).resolve().parent / "results"
QUERY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--tables", nargs="+", choices=("latency", "decoding"), default=["latency", "decoding"])
    p.add_argument("--base", help="AR base export (HF dir)")
    p.add_argument("--idlm", help="I-DLM export (recipe=idlm)")
    p.add_argument("--risd", help="gated-LoRA export (recipe=idlm_lora)")
    p.add_argument("--jacobi", help="Jacobi Forcing export (round 2)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--cache", type=int, default=1024, help="KV-cache tokens of the latency table")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda (what the tables are for); cpu runs the same code")
    p.add_argument("--out", default=str(RESULTS / "gpu_decoding"))
    args = p.parse_args()
    missing = [k for k in ("base", "idlm", "risd", "jacobi") if "decoding" in args.tables and not getattr(args, k)]
    if missing:
        p.error("the decoding table needs " + ", ".join(f"--{k}" for k in missing))
    return args


def timed_forward(model, cache: DynamicCache, ids: torch.Tensor) -> float:
    """Seconds of one cached forward of ``ids`` [1, q]; the cache is cropped back after it."""
    synchronize(ids.device)
    start = time.perf_counter()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    synchronize(ids.device)
    elapsed = time.perf_counter() - start
    cache.crop(-ids.shape[1])  # negative: drop the q entries just written
    return elapsed


def latency_table(args) -> tuple[list[dict], str]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen25_05b_shape(), attn_implementation="sdpa", dtype=torch.bfloat16)
    model.to(args.device).eval()
    g = torch.Generator(device=args.device).manual_seed(0)
    rand = lambda n: torch.randint(0, VOCAB, (1, n), device=args.device, generator=g)  # noqa: E731
    rows = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=rand(args.cache), past_key_values=cache, use_cache=True)
        for q in QUERY_TOKENS:
            ids = rand(q)
            for _ in range(3):
                timed_forward(model, cache, ids)
            ms = statistics.median(timed_forward(model, cache, ids) for _ in range(args.repeats)) * 1e3
            rows.append({"query_tokens": q, "ms": ms})
        for r in rows:
            r["vs_one_token"] = r["ms"] / rows[0]["ms"]
        profile_note = profile_one_token(model, cache, rand(1))
    return rows, profile_note


def profile_one_token(model, cache: DynamicCache, ids: torch.Tensor) -> str:
    from torch.profiler import ProfilerActivity, profile

    synchronize(ids.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed_forward(model, cache, ids)
    events = prof.key_averages()
    busy_ms = gpu_busy_ms(events)
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return (f"one q = 1 forward under the profiler: wall {wall * 1e3:.2f} ms, GPU busy {busy_ms:.2f} ms "
            f"({busy_ms / (wall * 1e3):.0%}), {kernels} GPU kernels")


def decoding_table(args, on_row) -> list[dict]:
    """Decode with every row's decoder; ``on_row(table)`` after each row (a cut-short run keeps its rows)."""
    rows_eval = held_out_rows(args.num_samples)
    load = lambda path: load_checkpoint(path, device=args.device, dtype="bfloat16")  # noqa: E731
    models = {"base": load(args.base), "idlm": load(args.idlm), "risd": load(args.risd), "jacobi": load(args.jacobi)}
    common = {"max_new_tokens": args.max_new_tokens, "batch_size": 1}
    risd_stride = resolve_stride(models["risd"][0], None)
    n = resolve_block_size(models["jacobi"][0], None)
    plan = [
        ("AR greedy (base)", "base", {"name": "ar", **common}),
        ("AR greedy (I-DLM ckpt)", "idlm", {"name": "ar", **common}),
        ("ISD N=4 greedy (I-DLM)", "idlm", {"name": "isd", "stride": 4, **common}),
        (f"R-ISD N={risd_stride} greedy (gated LoRA)", "risd", {"name": "isd", "stride": risd_stride, **common}),
        ("AR greedy (Jacobi Forcing round 2)", "jacobi", {"name": "ar", **common}),
        (f"Jacobi n={n} (round 2)", "jacobi", {"name": "jacobi", "block_size": n, "draft_init": "context", **common}),
        (f"Jacobi n={2 * n} (round 2)", "jacobi",
         {"name": "jacobi", "block_size": 2 * n, "draft_init": "context", **common}),
        (f"Multi-block n={n} K=2 r=0.85 (round 2)", "jacobi",
         {"name": "multiblock", "block_size": n, "num_blocks": 2, "spawn_ratio": 0.85, "ngram_pool_size": 4,
          "verification_size": 4, "draft_init": "context", **common}),
    ]
    table, own_ar = [], {}
    warmup = rows_eval.select(range(min(2, len(rows_eval))))
    for label, which, decoder in plan:
        model, tok = models[which]
        evaluate(model, tok, warmup, decoder, agreement=False, shard=False)
        result = evaluate(model, tok, rows_eval, decoder, agreement=False, shard=False)
        m, recs = result.metrics, sorted(result.records, key=lambda r: r["index"])
        if decoder["name"] == "ar":
            own_ar[which] = recs
        own = own_ar["base" if which == "risd" else which]
        forwards = sum(r["forwards"] for r in recs)
        wall = sum(r["wall_time_s"] for r in recs)
        row = {"decoder": label, "accuracy": m["accuracy"], "identical_to_own_ar": identical(recs, own),
               "tpf": m["tpf"], "tps": m["tps"], "ms_per_forward": wall / forwards * 1e3}
        row["tps_ratio"] = row["tps"] / table[0]["tps"] if table else 1.0
        row["ratio_over_tpf"] = row["tps_ratio"] / row["tpf"]
        table.append(row)
        print(json.dumps(row), flush=True)
        on_row(table)
    return table


def write(path: Path, command: str, device: str, md: str, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".md").write_text(f"Command: {command}\nDevice: {device}, torch {torch.__version__}, bf16, "
                                       f"batch 1.\n\n{md}\n")
    path.with_suffix(".json").write_text(json.dumps({"device": device, "rows": payload}, indent=2))


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_decoding needs a CUDA GPU (--device cpu runs the same code on CPU)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    out = Path(args.out)
    checkpoints = f" --base {args.base} --idlm {args.idlm} --risd {args.risd} --jacobi {args.jacobi}"
    command = lambda table: (  # noqa: E731
        f"python -m benchmarks.gpu_decoding --tables {table} "
        + (f"--num-samples {args.num_samples}{checkpoints}" if table == "decoding" else f"--cache {args.cache}"))
    if "latency" in args.tables:
        latency_section(args, out, command("latency"), device)
    if "decoding" in args.tables:
        decoding_section(args, out, command("decoding"), device)


def latency_section(args, out: Path, command: str, device: str) -> None:
    latency, profile_note = latency_table(args)
    md = ("| query tokens | forward (ms) | / one token |\n|---|---|---|\n"
          + "\n".join(f"| {r['query_tokens']} | {r['ms']:.2f} | {r['vs_one_token']:.2f}x |" for r in latency)
          + f"\n\nRandom Qwen2.5-0.5B-shaped model, SDPA, KV cache of {args.cache} tokens; {profile_note}.")
    print(md, flush=True)
    write(out.with_name(out.name + "_latency"), command, device, md, latency)


def decoding_section(args, out: Path, command: str, device: str) -> None:
    def write_rows(table: list[dict]) -> str:
        md = ("| decoder | accuracy | = own AR greedy | TPF | TPS | TPS / AR | (TPS / AR) / TPF | ms / forward |\n"
              "|---|---|---|---|---|---|---|---|\n"
              + "\n".join(f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_own_ar']:.1%} | {r['tpf']:.2f} | "
                          f"{r['tps']:.1f} | {r['tps_ratio']:.2f}x | {r['ratio_over_tpf']:.2f} | "
                          f"{r['ms_per_forward']:.2f} |" for r in table))
        write(out.with_name(out.name + "_decoding"), command, device, md, table)
        return md

    print(write_rows(decoding_table(args, write_rows)), flush=True)


if __name__ == "__main__":
    main()
