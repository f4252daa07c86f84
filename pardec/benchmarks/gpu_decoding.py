# python -m pardec.benchmarks.gpu_decoding --base runs/default_base/hf \
#   --idlm runs/idlm_default/stages/03-stride4_more/hf --risd runs/idlm_lora_default/hf \
#   --jacobi runs/jacobi_forcing_default/stages/01-round2/hf   (needs a CUDA GPU)
"""Parallel decoding on GPU: forward latency against parallel query tokens, and TPS / AR greedy.

Two tables, one run, bf16, batch 1:

1. ``latency``: a randomly initialised model of Qwen2.5-0.5B shape (SDPA) holds a KV cache of
   ``--cache`` tokens; one forward of q new tokens (q = 1 ... 512) is timed (median of
   ``--repeats`` after warm-up, the cache cropped back after each). The cost of a parallel decoder's
   forward relative to an AR step is ``ms(q) / ms(1)``. One q = 1 forward is also profiled: the
   GPU's busy time against the wall time says how much of an AR step is launch and Python overhead.
2. ``decoding``: the embedded default's converted checkpoints decode the same held-out problems with
   AR greedy, ISD N=4 (I-DLM), R-ISD (gated LoRA), Jacobi and multi-block (Jacobi Forcing round 2),
   each after an untimed warm-up (and every model first decodes ``--warmup-problems`` problems).
   TPS / AR is against the base's AR greedy in this run, and ``(TPS / AR) / TPF`` is the fraction
   of the forward saving that reaches wall time; ``ms / forward`` against AR's says why it falls
   short. On CUDA each row then decodes ``--profile-samples``
   problems again under the profiler: GPU kernels and GPU busy time per forward, against the wall
   time per forward, say whether a step waits on the GPU, on kernel launches or on host work.
   ``--sdpa-backends`` restricts SDPA's kernels further: ``evaluate`` already decodes without cuDNN
   attention (``pardec.common.kv_cache.cached_step_attention``: it builds an execution plan per new shape,
   and a decode step's key length is new at every step).

3. ``steps`` (where a parallel step's wall time goes): the base checkpoint runs the decoders' step
   shapes on random tokens -- an AR step (q = 1), ISD's propose and verify
   steps (q = N and 2N-1, with the decoder's own :class:`StepMasks` mask) and a Jacobi step
   (q = n, transformers' causal mask over the cache) -- each step a forward, the argmax read on the
   host and a cache crop, as in the decoders. Each runs with the key length growing from step to
   step (as in decoding) and held fixed (the cache cropped back), under each SDPA kernel choice
   (``STEP_BACKENDS``), each choice in a fresh process. A growing key length that costs far more
   than a fixed one points at per-shape work on the host (an execution plan built for every new
   shape); the top host operators of a growing ISD step per choice are saved beside the table.
   Two decoder loops (AR greedy, Jacobi) of the base then run through ``evaluate``, as the
   framework runs them (cuDNN attention off) and with that switch bypassed.
4. ``graphs`` (the launch overhead, tried away): AR greedy steps of the base checkpoint with a
   ``StaticCache``, run eagerly and as one ``torch.compile(mode="reduce-overhead")`` step (CUDA
   graphs: the step's kernels are replayed without Python or per-kernel launches), against the
   eager ``DynamicCache`` step the decoders run. ``--graph-prompts`` random prompts of 48 tokens,
   ``--graph-steps`` greedy steps each (no EOS stop, so every variant runs the same steps), after
   one untimed prompt (compilation and graph capture); the tokens of each variant are compared
   with the eager ``DynamicCache`` ones.

Writes ``benchmarks/results/gpu_decoding_{latency,decoding,steps,graphs}.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pardec.benchmarks.common import RESULTS, held_out_rows, identical, write_results
from pardec.benchmarks.mask_backends import VOCAB, gpu_busy_ms, qwen25_05b_shape
from pardec.common.kv_cache import cache_argument, crop_cache
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.base import synchronize
from pardec.inference.decoders.isd import StepMasks, resolve_stride
from pardec.inference.decoders.jacobi import resolve_block_size
from pardec.inference.evaluate import evaluate

QUERY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
# steps table: label -> (query tokens, ISD step mask (clean, masks) or None for transformers' causal mask,
# cache growth per step: the tokens a step keeps)
STEP_KINDS = {
    "AR (q=1)": (1, None, 1),
    "ISD propose (q=4, step mask)": (4, (1, 3), 1),
    "ISD verify (q=7, step mask)": (7, (4, 3), 3),
    "Jacobi (q=16, causal)": (16, None, 3),
    "Jacobi (q=32, causal)": (32, None, 3),
}
STEP_BACKENDS = {"torch's choice": None, "no cuDNN": ["flash", "efficient", "math"], "efficient only": ["efficient"],
                 "cuDNN first": ["cudnn", "flash", "efficient", "math"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--tables", nargs="+", choices=("latency", "decoding", "steps", "graphs"),
                   default=["latency", "decoding", "steps", "graphs"])
    p.add_argument("--base", help="AR base export (HF dir)")
    p.add_argument("--idlm", help="I-DLM export (recipe=idlm)")
    p.add_argument("--risd", help="gated-LoRA export (recipe=idlm_lora)")
    p.add_argument("--jacobi", help="Jacobi Forcing export (round 2)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--cache", type=int, default=1024, help="KV-cache tokens of the latency table")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup-problems", type=int, default=10,
                   help="decoding table: problems each model decodes with AR greedy, untimed, before the first row")
    p.add_argument("--profile-samples", type=int, default=3,
                   help="problems decoded under the profiler per decoding row (kernels and GPU time per forward)")
    p.add_argument("--sdpa-backends", nargs="+", choices=SDPA_BACKENDS, default=None,
                   help="decoding table: restrict SDPA to these kernels (default: torch's own choice)")
    p.add_argument("--steps", type=int, default=64, help="timed steps per row of the steps table")
    p.add_argument("--graph-prompts", type=int, default=20)
    p.add_argument("--graph-steps", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cuda (what the tables are for); cpu runs the same code")
    p.add_argument("--out", default=str(RESULTS / "gpu_decoding"))
    args = p.parse_args()
    missing = [k for k in ("base", "idlm", "risd", "jacobi") if "decoding" in args.tables and not getattr(args, k)]
    if ("graphs" in args.tables or "steps" in args.tables) and not args.base and "base" not in missing:
        missing.append("base")
    if missing:
        p.error("the decoding, steps and graphs tables need " + ", ".join(f"--{k}" for k in missing))
    return args


def timed_forward(model, cache: DynamicCache, ids: torch.Tensor) -> float:
    """Seconds of one cached forward of ``ids`` [1, q]; the cache is cropped back after it."""
    synchronize(ids.device)
    start = time.perf_counter()
    model(input_ids=ids, **cache_argument(cache), use_cache=True)
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
        model(input_ids=rand(args.cache), **cache_argument(cache), use_cache=True)
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
    # the first timed row of the 2026-11-26 H200 run was its slowest AR row (6.43 ms per forward against
    # 4.20-5.21 for the same architecture); every model decodes some problems first, untimed
    first = rows_eval.select(range(min(args.warmup_problems, len(rows_eval))))
    for model, tok in models.values():
        evaluate(model, tok, first, {"name": "ar", **common}, agreement=False, shard=False)
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
    if args.device == "cuda":
        # after every timed row: in the first H200 run, profiling each row right after its timing was followed by
        # a 1.7x slower next row (same kernels per forward); the cause was not established
        profiled = rows_eval.select(range(min(args.profile_samples, len(rows_eval))))
        for row, (_, which, decoder) in zip(table, plan, strict=True):
            row.update(profile_decoder(*models[which], profiled, decoder))
        on_row(table)
    return table


def profile_decoder(model, tok, rows, decoder: dict) -> dict:
    """GPU kernels and GPU busy time per forward of ``decoder`` on ``rows``, under the profiler.

    Set against ``ms / forward`` (wall), they say whether a decoder's step is bound by the GPU,
    by kernel launches (kernels per forward) or by host work between them. The counts include
    each sample's prefill, which ``forwards`` excludes (docs/methods/conventions.md#counting), so they are
    slight over-counts.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = evaluate(model, tok, rows, decoder, agreement=False, shard=False)
    forwards = sum(r["forwards"] for r in result.records)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"kernels_per_forward": kernels / forwards, "gpu_ms_per_forward": gpu_busy_ms(events) / forwards}


def steps_table(args) -> tuple[list[dict], str]:
    """ms per decode step of each ``STEP_KINDS`` shape, key length growing and fixed, per ``STEP_BACKENDS``,
    and ms per forward of two decoder loops; the top host operators of a growing ISD verify step per choice.

    Each SDPA choice and each decoder loop runs in a fresh process: cuDNN caches its plans per process
    and shape, so a shape planned in one row would come free in the next.
    """
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")

    def fresh(fn, *fn_args):
        with spawn.Pool(1) as pool:
            return pool.apply(fn, fn_args)

    rows, profiles = [], []
    for label, names in STEP_BACKENDS.items():
        set_rows, profile = fresh(step_rows, args.base, args.device, args.steps, label, names)
        rows += set_rows
        profiles.append(f"SDPA {label}: ISD verify (q=7), key length growing, 16 steps\n{profile}")
    for label, framework in LOOP_VARIANTS.items():
        rows += fresh(decoder_loop_rows, args.base, args.device, args.max_new_tokens, label, framework)
    return rows, "\n\n".join(profiles)


def step_rows(base: str, device: str, steps: int, label: str, names: list[str] | None) -> tuple[list[dict], str]:
    """One ``STEP_BACKENDS`` choice (in its own process): every ``STEP_KINDS`` row, and a profile."""
    model, _ = load_checkpoint(base, device=device, dtype="bfloat16")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def run(kind: str, growing: bool, steps: int, prompt_len: int) -> float:
        """ms per step after a random prompt of ``prompt_len`` (distinct per call: no shape repeats)."""
        q, isd_shape, growth = STEP_KINDS[kind]
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, vocab, (1, prompt_len), generator=g).to(device), **cache_argument(cache),
              use_cache=True)
        masks = StepMasks(model.dtype, device)
        synchronize(model.device)
        start = time.perf_counter()
        for _ in range(steps):
            cache_len = cache.get_seq_length()
            ids = torch.randint(0, vocab, (1, q), generator=g).to(device)  # [1, q]
            positions = torch.arange(cache_len, cache_len + q, device=device).unsqueeze(0)  # [1, q]
            mask = masks.get(cache_len, *isd_shape) if isd_shape else None  # [1, 1, q, cache_len + q]
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(cache),
                           use_cache=True).logits
            logits[0].argmax(-1).tolist()  # the decoders read every step's argmax on the host
            crop_cache(cache, cache_len + (growth if growing else 0))
        synchronize(model.device)
        return (time.perf_counter() - start) / steps * 1e3

    rows = []
    with torch.no_grad(), sdpa_backends(names):
        for kind in STEP_KINDS:
            row = {"step": kind, "sdpa": label}
            try:
                run(kind, True, 4, 40)  # warm-up, on key lengths no timed step has
                row["growing_ms"] = run(kind, True, steps, 64)
                row["fixed_ms"] = run(kind, False, steps, 48)
            except RuntimeError as err:  # a kernel choice that cannot run this step shape
                row["error"] = str(err).splitlines()[0][:120]
            rows.append(row)
            print(json.dumps(row), flush=True)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                run("ISD verify (q=7, step mask)", True, 16, 400)
            profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        except RuntimeError as err:
            profile = f"no kernel: {str(err).splitlines()[0][:120]}"
    return rows, profile


# decoder loops of the steps table: label -> whether ``evaluate``'s own kernel choice (cuDNN off) stays
LOOP_VARIANTS = {"torch's choice (the framework's cuDNN switch bypassed)": False,
                 "the framework (evaluate: cuDNN attention off)": True}


def decoder_loop_rows(base: str, device: str, max_new_tokens: int, label: str, framework: bool) -> list[dict]:
    """ms per forward of AR greedy and Jacobi (n=16) decoding 8 held-out problems with the base (in its own process)."""
    import pardec.inference.evaluate

    if not framework:
        pardec.inference.evaluate.cached_step_attention = contextlib.nullcontext
    model, tok = load_checkpoint(base, device=device, dtype="bfloat16")
    rows = []
    for name, decoder in (("AR greedy decoder", {"name": "ar"}),
                          ("Jacobi decoder (n=16)", {"name": "jacobi", "block_size": 16})):
        records = evaluate(model, tok, held_out_rows(8), {**decoder, "max_new_tokens": max_new_tokens, "batch_size": 1},
                           agreement=False, shard=False).records
        rows.append({"step": name, "sdpa": label,
                     "decoder_ms": sum(r["wall_time_s"] for r in records) / sum(r["forwards"] for r in records) * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def graphs_table(args) -> list[dict]:
    """Per-token time of AR greedy steps: eager DynamicCache, eager StaticCache, compiled StaticCache."""
    from transformers import StaticCache

    model, _ = load_checkpoint(args.base, device=args.device, dtype="bfloat16")
    device, prompt_len = model.device, 48
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size - 1, (1, prompt_len), generator=g).to(device)
               for _ in range(args.graph_prompts + 1)]  # the first one is the untimed warm-up
    max_len = prompt_len + args.graph_steps + 1

    def step(cache, ids, position):  # one AR step: [1, 1] -> logits [1, 1, V]
        return model(input_ids=ids, position_ids=position.view(1, 1), cache_position=position, **cache_argument(cache),
                     use_cache=True, logits_to_keep=1).logits

    compiled_step = torch.compile(step, mode="reduce-overhead")

    static_cache = StaticCache(model.config, max_len)  # one per run, reset per prompt (as generate does)

    def greedy(prompt, kind: str) -> tuple[list[int], float]:
        if kind == "dynamic":
            cache = DynamicCache(config=model.config)
        else:
            cache = static_cache
            cache.reset()
        run = compiled_step if kind == "compiled" else step
        logits = model(input_ids=prompt, **cache_argument(cache), use_cache=True, logits_to_keep=1).logits  # prefill
        token, tokens = logits[:, -1].argmax(-1, keepdim=True), []  # [1, 1]
        synchronize(device)
        start = time.perf_counter()
        for i in range(args.graph_steps):
            if kind == "compiled":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten now
            logits = run(cache, token, torch.tensor([prompt_len + i], device=device))
            token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            tokens.append(int(token))  # the host reads every token, as a decoder checking EOS does
        synchronize(device)
        return tokens, time.perf_counter() - start

    rows, reference = [], None
    labels = {"dynamic": "eager, DynamicCache (as the decoders run)", "static": "eager, StaticCache",
              "compiled": "torch.compile reduce-overhead (CUDA graphs), StaticCache"}
    with torch.no_grad():
        for kind, label in labels.items():
            greedy(prompts[0], kind)
            runs = [greedy(p, kind) for p in prompts[1:]]
            tokens = [t for t, _ in runs]
            reference = reference or tokens
            ms = sum(w for _, w in runs) / (len(runs) * args.graph_steps) * 1e3
            rows.append({"step": label, "ms_per_token": ms,
                         "tokens_equal": sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(tokens)})
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["speedup"] = rows[0]["ms_per_token"] / r["ms_per_token"]
    return rows


def write(path: Path, command: str, device: str, md: str, payload) -> None:
    """One table through :func:`pardec.benchmarks.common.write_results` (its ``Machine:`` line and
    ``machines.json`` entry), with the device the decoders ran on (``--device``) above it."""
    write_results(path, command, f"Ran on: {device}, bf16, batch 1.\n\n{md}", {"device": device, "rows": payload})


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_decoding needs a CUDA GPU (--device cpu runs the same code on CPU)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    out = Path(args.out)
    checkpoints = f" --base {args.base} --idlm {args.idlm} --risd {args.risd} --jacobi {args.jacobi}"
    command = lambda table: (  # noqa: E731
        f"python -m pardec.benchmarks.gpu_decoding --tables {table} "
        + {"decoding": f"--num-samples {args.num_samples} --profile-samples {args.profile_samples} "
                       f"--warmup-problems {args.warmup_problems}{checkpoints}"
                       + (f" --sdpa-backends {' '.join(args.sdpa_backends)}" if args.sdpa_backends else ""),
           "latency": f"--cache {args.cache}",
           "steps": f"--steps {args.steps} --base {args.base}",
           "graphs": f"--graph-prompts {args.graph_prompts} --graph-steps {args.graph_steps} "
                     f"--base {args.base}"}[table])
    if "latency" in args.tables:
        latency_section(args, out, command("latency"), device)
    if "decoding" in args.tables:
        decoding_section(args, out, command("decoding"), device)
    if "steps" in args.tables:
        steps_section(args, out, command("steps"), device)
    if "graphs" in args.tables:
        rows = graphs_table(args)
        md = ("| AR greedy step (base checkpoint) | ms / token | speed-up | tokens equal to eager DynamicCache |\n"
              "|---|---|---|---|\n"
              + "\n".join(f"| {r['step']} | {r['ms_per_token']:.2f} | {r['speedup']:.2f}x | {r['tokens_equal']:.0%} |"
                          for r in rows)
              + f"\n\n{args.graph_prompts} random prompts of 48 tokens, {args.graph_steps} greedy steps each.")
        print(md, flush=True)
        write(out.with_name(out.name + "_graphs"), command("graphs"), device, md, rows)


def latency_section(args, out: Path, command: str, device: str) -> None:
    latency, profile_note = latency_table(args)
    md = ("| query tokens | forward (ms) | / one token |\n|---|---|---|\n"
          + "\n".join(f"| {r['query_tokens']} | {r['ms']:.2f} | {r['vs_one_token']:.2f}x |" for r in latency)
          + f"\n\nRandom Qwen2.5-0.5B-shaped model, SDPA, KV cache of {args.cache} tokens; {profile_note}.")
    print(md, flush=True)
    write(out.with_name(out.name + "_latency"), command, device, md, latency)


def steps_section(args, out: Path, command: str, device: str) -> None:
    rows, profile = steps_table(args)
    loops = [r for r in rows if "decoder_ms" in r]
    steps = [r for r in rows if r not in loops]
    cell = lambda r, k: f"{r[k]:.2f}" if k in r else "no kernel"  # noqa: E731
    md = ("| step | SDPA kernels | ms / step, key length growing | ms / step, key length fixed | growing / fixed |\n"
          "|---|---|---|---|---|\n"
          + "\n".join(f"| {r['step']} | {r['sdpa']} | {cell(r, 'growing_ms')} | {cell(r, 'fixed_ms')} | "
                      + (f"{r['growing_ms'] / r['fixed_ms']:.2f}x |" if "error" not in r else "|") for r in steps)
          + "\n\n| decoder loop (base checkpoint, 8 held-out problems) | SDPA kernels | ms / forward |\n|---|---|---|\n"
          + "\n".join(f"| {r['step']} | {r['sdpa']} | {cell(r, 'decoder_ms')} |" for r in loops)
          + f"\n\nThe base checkpoint on random tokens; {args.steps} timed steps per cell, after 4 untimed ones on "
          "other key lengths; a step is the forward, the host reading its argmax and the cache crop. Growing: "
          "after a 64-token prompt, the cache keeps the step's tokens (1 for AR and ISD propose, 3 otherwise), "
          "so every step's key length is new; fixed: after a 48-token prompt, cropped back after each step. "
          "Each SDPA choice, and each decoder loop, ran in a fresh process (cuDNN caches its plans per process "
          "and shape).")
    print(md, flush=True)
    write(out.with_name(out.name + "_steps"), command, device, md, rows)
    out.with_name(out.name + "_steps_profile.txt").write_text(profile + "\n")


def decoding_section(args, out: Path, command: str, device: str) -> None:
    def write_rows(table: list[dict]) -> str:
        profiled = "kernels_per_forward" in table[0]
        extra = lambda r: (f" {r['kernels_per_forward']:.0f} | {r['gpu_ms_per_forward']:.2f} |"  # noqa: E731
                           if profiled else "")
        md = ("| decoder | accuracy | = own AR greedy | TPF | TPS | TPS / AR | (TPS / AR) / TPF | ms / forward |"
              + (" GPU kernels / forward | GPU busy ms / forward |" if profiled else "") + "\n"
              + "|---" * (10 if profiled else 8) + "|\n"
              + "\n".join(f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_own_ar']:.1%} | {r['tpf']:.2f} | "
                          f"{r['tps']:.1f} | {r['tps_ratio']:.2f}x | {r['ratio_over_tpf']:.2f} | "
                          f"{r['ms_per_forward']:.2f} |" + extra(r) for r in table))
        if profiled:
            md += (f"\n\nGPU kernels and GPU busy time per forward: {args.profile_samples} problems per row decoded "
                   "again under torch.profiler (each sample's prefill included).")
        write(out.with_name(out.name + "_decoding"), command, device, md, table)
        return md

    with sdpa_backends(args.sdpa_backends):
        print(write_rows(decoding_table(args, write_rows)), flush=True)


def sdpa_backends(names: list[str] | None):
    """``torch.nn.attention.sdpa_kernel`` restricted to ``names``, or no restriction for ``None``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if names is None:
        return contextlib.nullcontext()
    by_name = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([by_name[n] for n in names])


if __name__ == "__main__":
    main()
