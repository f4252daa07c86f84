# python -m pardec.benchmarks.flex_kernels --recipes jacobi_streams --lengths 8192 16384   (needs a CUDA GPU)
"""One attention call alone, forward + backward: FlexAttention's kernel choices against SDPA's causal kernel (GPU).

Where a structured-mask training step loses time to the plain causal floor, with the rest of the
model taken away: one layer's attention of Qwen2.5-0.5B shape (14 query heads on 2 K/V heads, head
size 64, bf16, batch 1) over one packed row of ``pardec.benchmarks.mask_backends``' recipes. Rows, each
timed with CUDA events (median of ``--reps`` after ``--warmup`` calls, compilation in warm-up):

* ``sdpa causal``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, plain causal
  attention with SDPA's own kernel choice (the training benchmark's floor profiled as cuDNN's flash
  kernel on an H100);
* ``flex causal``: FlexAttention on a plain causal ``BlockMask``: flex's own kernel on the floor's
  tiles, so ``flex causal / sdpa causal`` is the kernel gap and the recipe rows show what the mask
  adds on top;
* ``flex <recipe>, <choice>``: the recipe's ``BlockMask`` (``pardec.masks.core.flex_block_mask``) through
  ``pardec.models.flex_attention`` with each kernel choice of :data:`CHOICES` (``kernel_options``, the
  compile mode and whether K/V heads are repeated to the query heads,
  :func:`pardec.models.flex_attention.configure`; ``autotuned`` is ``AUTOTUNED_HOPPER_HEAD_DIM_64``,
  max-autotune's pick on an H200). A choice torch rejects is reported with its error. ``max abs diff
  vs default`` compares output and input gradients with those of the first choice that ran;
* ``--with-causal``: each choice also on the plain causal ``BlockMask`` (``flex causal, <choice>``),
  to tell a kernel choice's gain on any mask from its gain on the recipe's;
* ``--block-sizes 128 64``: the recipe's ``BlockMask`` built with other tile sides too (a choice's
  kernel tiles must divide them).

The BlockMask build (once per training step, shared by the layers) is timed apart. ``--best-out``
writes the fastest choice (forward + backward, the recipe of ``--recipes``' first entry at the
largest length, torch's 128-token BlockMask) as JSON for ``pardec.benchmarks.mask_backends --flex-choice``.
Rows are written as they are measured to ``benchmarks/results/flex_kernels.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from pardec.benchmarks.common import RESULTS, invoked_command, write_results
from pardec.benchmarks.mask_backends import RECIPES
from pardec.masks.core import causal, flex_block_mask
from pardec.methods.base import move_batch
from pardec.models import flex_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 14, 2, 64, 24
DEFAULT_BLOCK = 128  # torch's BlockMask tile side
# (name, kernel_options, compile mode, K/V heads repeated to the query heads); torch's defaults first:
# every other choice is compared with it.
CHOICES = [
    ("default", {}, None, False),
    ("fwd 128x64", {"BLOCK_M": 128, "BLOCK_N": 64}, None, False),
    ("fwd 64x64", {"BLOCK_M": 64, "BLOCK_N": 64}, None, False),
    ("bwd 64x64", {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}, None, False),
    ("bwd 32x64", {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}, None, False),
    ("TMA", {"USE_TMA": True}, None, False),
    ("safe rows", {"ROWS_GUARANTEED_SAFE": True}, None, False),
    ("max-autotune", {}, "max-autotune-no-cudagraphs", False),
    ("autotuned", flex_attention.AUTOTUNED_HOPPER_HEAD_DIM_64, None, False),
    ("default, repeat K/V", {}, None, True),
    ("autotuned, repeat K/V", flex_attention.AUTOTUNED_HOPPER_HEAD_DIM_64, None, True),
]


def qkv(length: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    shapes = [(1, HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM), (1, KV_HEADS, length, HEAD_DIM)]
    return tuple(torch.randn(s, generator=g).cuda().bfloat16().requires_grad_() for s in shapes)


def time_call(fn, inputs, grad_out, reps: int, warmup: int) -> tuple[dict, list[torch.Tensor]]:
    """Median forward and forward + backward milliseconds of ``fn(*inputs)``, and the output and input
    gradients of its last call (to compare choices)."""
    fwd, total = [], []
    for i in range(warmup + reps):
        for t in inputs:
            t.grad = None
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = fn(*inputs)
        mid.record()
        out.backward(grad_out)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            fwd.append(start.elapsed_time(mid))
            total.append(start.elapsed_time(end))
    f, t = statistics.median(fwd), statistics.median(total)
    return {"fwd_ms": f, "bwd_ms": t - f, "total_ms": t}, [out.detach()] + [x.grad.detach().clone() for x in inputs]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def time_block_mask(spec, reps: int, block_size: int) -> float:
    flex_block_mask(spec, block_size=block_size)  # compiles
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        flex_block_mask(spec, block_size=block_size)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(recipe: str, length: int, args, g: torch.Generator, save) -> list[dict]:
    """This recipe's rows at ``length``; ``save(rows)`` after each (a run cut short keeps them)."""
    label, build = RECIPES[recipe]
    spec = move_batch(build(length, g), "cuda")["attention"]
    inputs = qkv(length, g)
    grad_out = torch.randn(1, length, HEADS, HEAD_DIM, generator=g).cuda().bfloat16()  # [b, q, h, d]
    rows = []

    def row(name: str, stats: dict) -> None:
        if "fwd_ms" in stats and rows:  # rows[0] is SDPA's causal kernel
            stats = {**stats, "vs_sdpa_causal": stats["total_ms"] / rows[0]["total_ms"]}
        rows.append({"recipe": label, "seq_len": length, "kernel": name, **stats})
        print(json.dumps(rows[-1]), flush=True)
        save(rows)

    def flex_on(mask):
        return lambda q, k, v: flex_attention.compiled_flex_attention(None, q, k, v, mask)[0]

    def sdpa_causal(q, k, v):  # [b, q, h, d], as the flex entry returns it
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    row("sdpa causal", {**time_call(sdpa_causal, inputs, grad_out, args.reps, args.warmup)[0], "vs_sdpa_causal": 1.0})
    flex_attention.configure()
    causal_mask = create_block_mask(causal, 1, None, length, length, device="cuda")
    row("flex causal, default", time_call(flex_on(causal_mask), inputs, grad_out, args.reps, args.warmup)[0])
    reference = None
    for block_size in args.block_sizes:
        tiles = "" if block_size == DEFAULT_BLOCK else f", {block_size}-token BlockMask"
        row(f"BlockMask build (per step){tiles}", {"total_ms": time_block_mask(spec, args.reps, block_size)})
        masks = {recipe: flex_block_mask(spec, block_size=block_size)}
        if args.with_causal:
            masks["causal"] = create_block_mask(causal, 1, None, length, length, device="cuda", BLOCK_SIZE=block_size)
        for name, options, mode, repeat_kv in CHOICES:
            if name not in args.choices:
                continue
            flex_attention.configure(options, mode, repeat_kv)
            for mask_name, block_mask in masks.items():
                if mask_name == "causal" and name == "default" and block_size == DEFAULT_BLOCK:
                    continue  # the reference row above
                kernel = f"flex {mask_name}, {name}{tiles}"
                try:
                    stats, tensors = time_call(flex_on(block_mask), inputs, grad_out, args.reps, args.warmup)
                except Exception as error:  # a choice torch rejects (unknown option, tiles that do not fit)
                    row(kernel, {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
                    continue
                extra = {}
                if mask_name == recipe:
                    reference = reference or tensors
                    extra = {"max_diff_vs_default": max_diff(tensors, reference)}
                row(kernel, {**stats, "mask": mask_name, "kernel_options": options, "compile_mode": mode,
                            "repeat_kv": repeat_kv, "block_size": block_size, **extra})
    flex_attention.configure()
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    lines = ["| recipe | tokens | kernel | forward (ms) | backward (ms) | fwd + bwd (ms) | x 24 layers (ms) "
             "| / sdpa causal | max abs diff vs default |", "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['seq_len']} | {r['kernel']} | {r['error']} | | | | | |")
            continue
        per_model = LAYERS * r["total_ms"] if "fwd_ms" in r else None  # the mask is built once per step
        lines.append(f"| {r['recipe']} | {r['seq_len']} | {r['kernel']} | {fmt(r.get('fwd_ms'), '.3f')} | "
                     f"{fmt(r.get('bwd_ms'), '.3f')} | {r['total_ms']:.3f} | {fmt(per_model, '.1f')} | "
                     f"{fmt(r.get('vs_sdpa_causal'), '.2f')} | {fmt(r.get('max_diff_vs_default'), '.2g')} |")
    return "\n".join(lines)


def best_choice(rows: list[dict], recipe_label: str, length: int) -> dict:
    """The fastest choice by kernel options alone on the recipe's own mask with torch's BlockMask tiles
    (a compile mode such as max-autotune re-tunes at every new shape, minutes of a benchmark's time, and
    training builds its masks with torch's tiles, so those rows are reported but not handed on)."""
    timed = [r for r in rows if r["recipe"] == recipe_label and r["seq_len"] == length and "kernel_options" in r
             and r["compile_mode"] is None and r.get("mask") != "causal"
             and r.get("block_size", DEFAULT_BLOCK) == DEFAULT_BLOCK]
    best = min(timed, key=lambda r: r["total_ms"])
    return {"name": best["kernel"], "kernel_options": best["kernel_options"], "compile_mode": best["compile_mode"],
            "repeat_kv": best.get("repeat_kv", False), "total_ms": best["total_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["jacobi_streams"])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--choices", nargs="+", choices=[c[0] for c in CHOICES], default=[c[0] for c in CHOICES])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[DEFAULT_BLOCK],
                   help="BlockMask tile sides to try (each choice's kernel tiles must divide them)")
    p.add_argument("--with-causal", action="store_true",
                   help="also time each choice on a plain causal BlockMask (kernel gap against mask cost)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "flex_kernels"))
    p.add_argument("--best-out", default=None, help="write the fastest choice here (JSON)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_kernels needs a CUDA GPU (FlexAttention has no CPU backward)")
    torch._dynamo.config.recompile_limit = 64  # one static kernel per (mask, length, choice)
    g = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name()
    command = invoked_command("pardec.benchmarks.flex_kernels")
    rows = []

    def save(new_rows: list[dict]) -> None:
        done = rows + new_rows
        write_results(args.out, command, markdown(done),
                      {"device": device, "torch": torch.__version__, "command": command, "rows": done})

    for recipe in args.recipes:
        for length in args.lengths:
            rows += measure(recipe, length, args, g, save)
    print(markdown(rows))
    if args.best_out:
        best = best_choice(rows, RECIPES[args.recipes[0]][0], max(args.lengths))
        Path(args.best_out).write_text(json.dumps(best))
        print("best:", json.dumps(best))


if __name__ == "__main__":
    main()
