# python -m benchmarks.mask_backends --lengths 1024 2048 4096   (needs a CUDA GPU)
"""Training-step time and peak memory of FlexAttention BlockMasks vs dense SDPA masks (GPU).

One packed training step (forward + backward, bf16) of a randomly initialised model of
Qwen2.5-0.5B shape on an I-DLM ``[x_t | x_0]`` batch (stride 4) and a Jacobi Forcing NC batch
(n = 16), each at several sequence lengths. Both backends get the same batch and the same mask
predicate (``masks/``): ``flex_attention`` with a compiled ``create_block_mask`` BlockMask, and
``sdpa`` with the dense float additive mask. Times are medians over timed steps after warm-up,
with the device synchronised; memory is ``torch.cuda.max_memory_allocated`` of the step.
Writes ``benchmarks/results/mask_backends.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from data_pipelines.idlm_batch import build_idlm_batch
from data_pipelines.jacobi_batch import build_jacobi_batch
from methods.base import forward_logits, move_batch

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 32_000
MASK_ID = VOCAB - 1


def qwen25_05b_shape() -> Qwen2Config:
    return Qwen2Config(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192,
                       tie_word_embeddings=True)


def idlm_batch(length: int, g: torch.Generator) -> dict:
    # samples of L = 256 tokens (prompt 64) fill a row of `length` slots ([x_t | x_0] = 2L each)
    n = length // 512
    samples = [{"input_ids": torch.randint(0, VOCAB - 1, (256,), generator=g).tolist(), "prompt_len": 64}
               for _ in range(n)]
    return build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=3, pack_length=length, pad_token_id=0)


def jacobi_batch(length: int, g: torch.Generator) -> dict:
    # one sample: prompt of 128 tokens + N blocks of n = 16 (noisy + clean) filling the row
    n, prompt = 16, 128
    blocks = (length - prompt) // (2 * n)
    rand = lambda k: torch.randint(0, VOCAB - 1, (k,), generator=g).tolist()  # noqa: E731
    clean = [rand(n) for _ in range(blocks)]
    noisy = [[c[0]] + rand(n - 1) for c in clean]  # a Jacobi state's first token is always exact
    sample = {"prompt_ids": rand(prompt), "noisy_blocks": noisy, "clean_blocks": clean, "valid_lens": [n] * blocks}
    return build_jacobi_batch([sample], block_size=n, pack_length=length, pad_token_id=0)


def time_step(model, batch, steps: int, warmup: int) -> tuple[float, float]:
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = forward_logits(model, batch)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["input_ids"].flatten())
        loss.backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "mask_backends"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mask_backends needs a CUDA GPU (FlexAttention has no CPU backward)")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    models = {impl: AutoModelForCausalLM.from_config(qwen25_05b_shape(), attn_implementation=impl, dtype=torch.bfloat16)
              for impl in ("sdpa", "flex_attention")}
    models["flex_attention"].load_state_dict(models["sdpa"].state_dict())
    rows = []
    for recipe, build in (("I-DLM stride 4", idlm_batch), ("Jacobi Forcing NC n=16", jacobi_batch)):
        for length in args.lengths:
            batch = move_batch(build(length, g), "cuda")
            result = {"recipe": recipe, "seq_len": length}
            for impl, model in models.items():
                model.cuda().train()
                step_s, peak_gib = time_step(model, batch, args.steps, args.warmup)
                result[impl] = {"step_ms": step_s * 1e3, "peak_gib": peak_gib}
                model.cpu()
                torch.cuda.empty_cache()
            result["flex_speedup"] = result["sdpa"]["step_ms"] / result["flex_attention"]["step_ms"]
            result["flex_memory_ratio"] = result["flex_attention"]["peak_gib"] / result["sdpa"]["peak_gib"]
            rows.append(result)
            print(json.dumps(result), flush=True)
    header = ("| recipe | seq len | dense SDPA step (ms) | flex step (ms) | flex speed-up | dense peak (GiB) | "
              "flex peak (GiB) | flex / dense memory |\n|---|---|---|---|---|---|---|---|")
    lines = [header] + [
        f"| {r['recipe']} | {r['seq_len']} | {r['sdpa']['step_ms']:.1f} | {r['flex_attention']['step_ms']:.1f} | "
        f"{r['flex_speedup']:.2f}x | {r['sdpa']['peak_gib']:.2f} | {r['flex_attention']['peak_gib']:.2f} | "
        f"{r['flex_memory_ratio']:.2f} |" for r in rows
    ]
    md = "\n".join(lines)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    out.with_suffix(".md").write_text(
        f"Command: python -m benchmarks.mask_backends --lengths {' '.join(map(str, args.lengths))}\n"
        f"Device: {device}, torch {torch.__version__}, bf16, random Qwen2.5-0.5B-shaped model, batch 1 row.\n\n{md}\n")
    out.with_suffix(".json").write_text(json.dumps({"device": device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
