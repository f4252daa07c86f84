# python -m pardec.benchmarks.mask_backends --lengths 4096 8192 16384 32768   (needs a CUDA GPU)
"""Training-step time and peak memory of structured masks: FlexAttention vs dense SDPA vs plain causal (GPU).

One packed training step (forward + backward, bf16, batch 1 row) of a randomly initialised model of
Qwen2.5-0.5B shape on an I-DLM ``[x_t | x_0]`` row (stride 4, samples of 2 x 256 tokens) and a Jacobi
Forcing noise-conditioned row (n = 32; ``jacobi``: the interleaved layout of docs/methods/jacobi_forcing.md#packing,
``jacobi_streams``: the same attention with each stream contiguous, ``recipe.layout=streams``), at
several total tokens per row. Columns, all on the same model and the same tokens:

* ``causal``: SDPA with no mask and plain positions (``is_causal``, the flash kernel): the floor a
  structured mask is measured against, no structure at all;
* ``sdpa``: the recipe's mask predicate as a dense float additive mask ``[1, 1, s, s]``;
* ``flex_attention``: the same predicate as a compiled ``BlockMask``, through transformers' own
  FlexAttention entry;
* ``pardec_flex``: the same ``BlockMask`` through ``pardec/models/flex_attention.py``.

Times are medians over timed steps after warm-up steps (compilation happens in warm-up), with the
device synchronised; memory is ``torch.cuda.max_memory_allocated`` of the cell's steps; a cell that
runs out of memory is reported as such. ``--flex-choice F`` runs ``pardec_flex`` with the kernel
choice in ``F`` (``pardec.benchmarks.flex_kernels``). ``--profile L`` also writes a ``torch.profiler`` table of one
step per backend on a row of ``L`` tokens of ``--profile-recipe`` (I-DLM by default). Writes
``benchmarks/results/mask_backends.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from pardec.benchmarks.common import RESULTS, current_machine, machine_name, write_results
from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.data_pipelines.jacobi_batch import build_jacobi_batch
from pardec.methods.base import forward_logits, move_batch
from pardec.models import flex_attention

VOCAB = 32_000
MASK_ID = VOCAB - 1
BACKENDS = ("causal", "sdpa", "flex_attention", "pardec_flex")
JACOBI_N = 32


def qwen25_05b_shape() -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True)


def idlm_batch(length: int, g: torch.Generator) -> dict:
    # samples of L = 256 tokens (prompt 64) fill a row of `length` slots ([x_t | x_0] = 2L each)
    n = length // 512
    samples = [{"input_ids": torch.randint(0, VOCAB - 1, (256,), generator=g).tolist(), "prompt_len": 64}
               for _ in range(n)]
    return build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=3, pack_length=length, pad_token_id=0)


def jacobi_batch(length: int, g: torch.Generator, layout: str = "interleaved") -> dict:
    # one sample: prompt of 128 tokens + blocks of n (noisy + clean) filling the row
    n, prompt = JACOBI_N, 128
    blocks = (length - prompt) // (2 * n)
    rand = lambda k: torch.randint(0, VOCAB - 1, (k,), generator=g).tolist()  # noqa: E731
    clean = [rand(n) for _ in range(blocks)]
    noisy = [[c[0]] + rand(n - 1) for c in clean]  # a Jacobi state's first token is always exact
    sample = {"prompt_ids": rand(prompt), "noisy_blocks": noisy, "clean_blocks": clean, "valid_lens": [n] * blocks}
    return build_jacobi_batch([sample], block_size=n, pack_length=length, pad_token_id=0, layout=layout)


def jacobi_streams_batch(length: int, g: torch.Generator) -> dict:
    return jacobi_batch(length, g, layout="streams")


def causal_batch(batch: dict) -> dict:
    """The same tokens with plain positions and no mask: SDPA then runs its causal kernel."""
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return {"input_ids": ids, "position_ids": positions}


def train_step(model, batch) -> None:
    logits = forward_logits(model, batch)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["input_ids"].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def time_step(model, batch, steps: int, warmup: int) -> dict:
    times = []
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(model, batch)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"step_ms": None, "peak_gib": None, "oom": True}
    return {"step_ms": statistics.median(times) * 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "oom": False}


def profile_steps(model, batch, label: str, length: int, backends: list[str], out: Path, command: str) -> None:
    """One profiled step of a ``label`` row per backend, after two unprofiled steps (compilation)."""
    from torch.profiler import ProfilerActivity, profile

    sections = []
    for impl in backends:
        model.set_attn_implementation("sdpa" if impl == "causal" else impl)
        cell = causal_batch(batch) if impl == "causal" else batch
        for _ in range(2):
            train_step(model, cell)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step(model, cell)
            torch.cuda.synchronize()
        events = prof.key_averages()
        busy_ms = gpu_busy_ms(events)
        wall_ms = timed_wall(model, cell)
        sections.append(f"## {impl}, {label}, {length} tokens: step {wall_ms:.1f} ms wall (unprofiled), "
                        f"GPU busy {busy_ms:.1f} ms ({busy_ms / wall_ms:.0%})\n\n"
                        + events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60)
                        + "\n" + events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    text = "\n\n".join(sections)
    print(text, flush=True)
    out.with_name(out.name + "_profile.txt").write_text(
        f"Command: {command}\nMachine: {machine_name(current_machine())}\n\n"
        + text + "\n")


def gpu_busy_ms(events) -> float:
    """GPU time of a profile: the kernels' own time (operators also carry their kernels' time)."""
    return sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def timed_wall(model, batch) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    train_step(model, batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def ratio(num: dict, den: dict) -> float | None:
    if num.get("step_ms") is None or den.get("step_ms") is None:
        return None
    return num["step_ms"] / den["step_ms"]


RECIPES = {"idlm": ("I-DLM stride 4", idlm_batch), "jacobi": (f"Jacobi Forcing NC n={JACOBI_N}", jacobi_batch),
           "jacobi_streams": (f"Jacobi Forcing NC n={JACOBI_N}, streams layout", jacobi_streams_batch)}
COLUMNS = {"causal": "causal floor", "sdpa": "dense SDPA", "flex_attention": "flex, transformers",
           "pardec_flex": "flex, pardec"}


def markdown(rows: list[dict], backends: list[str]) -> str:
    fmt = lambda v, spec: "OOM" if v is None else format(v, spec)  # noqa: E731
    names = [COLUMNS[b] for b in backends]
    header = ("| recipe | tokens | " + " | ".join(f"{n} (ms)" for n in names)
              + " | pardec flex / floor | dense / pardec flex | " + " | ".join(f"{n} peak (GiB)" for n in names) + " |")
    lines = [header, "|" + "---|" * (4 + 2 * len(backends))]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['seq_len']} | " + " | ".join(fmt(r[b]["step_ms"], ".1f") for b in backends)
                     + f" | {fmt(r['pardec_flex_over_causal'], '.2f')}x | {fmt(r['sdpa_over_pardec_flex'], '.2f')}x | "
                     + " | ".join(fmt(r[b]["peak_gib"], ".2f") for b in backends) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["idlm", "jacobi"])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=["causal", "sdpa", "pardec_flex"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", type=int, default=None, metavar="TOKENS",
                   help="first profile one step per backend of a --profile-recipe row of this many tokens")
    p.add_argument("--profile-recipe", choices=sorted(RECIPES), default="idlm")
    p.add_argument("--out", default=str(RESULTS / "mask_backends"))
    p.add_argument("--flex-choice", default=None, metavar="JSON",
                   help="pardec_flex's kernel choice, a file written by pardec.benchmarks.flex_kernels --best-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mask_backends needs a CUDA GPU (FlexAttention has no CPU backward)")
    flex_attention.register()
    choice = json.loads(Path(args.flex_choice).read_text()) if args.flex_choice else None
    if choice:
        flex_attention.configure(choice["kernel_options"], choice["compile_mode"], choice.get("repeat_kv", False))
    # Every (mask predicate, row length) compiles its own BlockMask builder and static flex kernel:
    # 2 recipes x 4 lengths go past dynamo's default of 8 compiles per function, after which it would
    # silently fall back to eager (unfused) attention.
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen25_05b_shape(), attn_implementation="sdpa", dtype=torch.bfloat16)
    model.cuda().train()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    command = (f"python -m pardec.benchmarks.mask_backends --lengths {' '.join(map(str, args.lengths))} "
               f"--recipes {' '.join(args.recipes)} --backends {' '.join(args.backends)} "
               f"--steps {args.steps} --warmup {args.warmup}"
               + (f" --flex-choice {args.flex_choice}" if args.flex_choice else ""))
    if args.profile:
        label, build = RECIPES[args.profile_recipe]
        profile_steps(model, move_batch(build(args.profile, g), "cuda"), label, args.profile, args.backends, out,
                      command + f" --profile {args.profile} --profile-recipe {args.profile_recipe}")
    flex_note = (f" pardec flex runs kernel choice {choice['name']!r} (kernel_options {choice['kernel_options']}, "
                 f"compile mode {choice['compile_mode']}, K/V heads repeated: {choice.get('repeat_kv', False)})."
                 if choice else "")
    rows = []
    for recipe in args.recipes:
        label, build = RECIPES[recipe]
        for length in args.lengths:
            batch = move_batch(build(length, g), "cuda")
            result = {"recipe": label, "seq_len": length}
            for impl in args.backends:
                model.set_attn_implementation("sdpa" if impl == "causal" else impl)
                result[impl] = time_step(model, causal_batch(batch) if impl == "causal" else batch,
                                         args.steps, args.warmup)
            none = {"step_ms": None}
            result["pardec_flex_over_causal"] = ratio(result.get("pardec_flex", none), result.get("causal", none))
            result["sdpa_over_pardec_flex"] = ratio(result.get("sdpa", none), result.get("pardec_flex", none))
            rows.append(result)
            print(json.dumps(result), flush=True)
            # written after every row: a run cut short keeps what it measured
            md = markdown(rows, args.backends)
            write_results(out, command, f"bf16, random Qwen2.5-0.5B-shaped model, batch 1 row.{flex_note}\n\n{md}",
                          {"device": device, "torch": torch.__version__, "command": command, "flex_choice": choice,
                           "rows": rows})
    print(md)
    from torch._dynamo.utils import counters

    print("dynamo:", json.dumps({k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles")}))


if __name__ == "__main__":
    main()
