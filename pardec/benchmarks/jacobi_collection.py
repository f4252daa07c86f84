# python -m pardec.benchmarks.jacobi_collection --model runs/smollm2_sft/hf --num-prompts 8 --batch-sizes 1 8
"""Jacobi trajectory collection one prompt at a time against batches of prompts, side by side in one
run (docs/methods/jacobi_forcing.md#trajectory-collection).

The first ``--num-prompts`` training prompts (the generator's train split, rendered as ``--template``)
are collected by ``pardec.data_pipelines.jacobi_trajectories.collect_trajectories`` (what a Jacobi
Forcing stage runs, AR-greedy check included) at each of ``--batch-sizes`` in turn, after one
untimed warm-up prompt. Columns: seconds, prompts per second, speed-up over the first batch size
(list 1 first), forwards per prompt, and the share of rows equal to the first batch size's
(states, fixed points, valid lengths, EOS flag, forwards: a batch changes none of them, up to the
kernels' rounding).

Writes ``benchmarks/results/jacobi_collection.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pardec.benchmarks.common import RESULTS, add_runtime_args, invoked_command, write_results
from pardec.common.kv_cache import cached_step_attention
from pardec.data_pipelines.config import DataConfig
from pardec.data_pipelines.jacobi_trajectories import (
    CollectSettings,
    collect_batch,
    collect_trajectories,
    load_trajectories,
)
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import format_prompt_ids, stop_token_ids
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.base import model_device, synchronize

COMPARED = ("states", "fixed_points", "valid_lens", "hit_eos", "forwards")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="AR checkpoint (HF dir) whose trajectories are collected")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="the first is the reference")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy-atol", type=float, default=None, help="null: 0 in float32, 0.5 in 16-bit")
    add_runtime_args(p, cuda_graphs=False)
    p.add_argument("--out", default=str(RESULTS / "jacobi_collection"))
    args = p.parse_args(argv)
    if args.num_prompts < 1 or min(args.batch_sizes) < 1:
        p.error("--num-prompts and every --batch-sizes value must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    data_cfg = OmegaConf.structured(DataConfig)
    data_cfg.max_train_samples = args.num_prompts
    prompts = [format_prompt_ids(tok, row["prompt"], args.template) for row in load_raw_split(data_cfg, "train")]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # training's rule (models.loading)
    settings = CollectSettings(block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                               eos_token_ids=tuple(sorted(stop_token_ids(tok))), pad_token_id=pad,
                               greedy_atol=args.greedy_atol, shard_size=len(prompts))
    device = model_device(model)
    with cached_step_attention():
        collect_batch(model, [0], prompts[:1], settings)  # warm-up, untimed
    table, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in args.batch_sizes:
            directory = Path(tmp) / f"batch{batch_size}"
            synchronize(device)
            start = time.perf_counter()
            collect_trajectories(model, prompts, directory, dataclasses.replace(settings, batch_size=batch_size))
            synchronize(device)
            seconds = time.perf_counter() - start
            rows = [{k: r[k] for k in COMPARED} for r in load_trajectories(directory)]
            reference = reference or rows
            equal = sum(a == b for a, b in zip(rows, reference)) / len(rows)
            table.append({"batch_size": batch_size, "seconds": seconds, "prompts_per_s": len(rows) / seconds,
                          "forwards_per_prompt": sum(r["forwards"] for r in rows) / len(rows),
                          "equal_to_first": equal})
    for row in table:
        row["speedup"] = table[0]["seconds"] / row["seconds"]
    md = "\n".join(["| prompts per batch | seconds | prompts / s | speed-up | forwards / prompt | rows = first |",
                    "|---|---|---|---|---|---|"] + [
        f"| {r['batch_size']} | {r['seconds']:.1f} | {r['prompts_per_s']:.2f} | {r['speedup']:.2f}x | "
        f"{r['forwards_per_prompt']:.1f} | {r['equal_to_first']:.0%} |" for r in table])
    print(md, flush=True)
    write_results(args.out, invoked_command("pardec.benchmarks.jacobi_collection", argv),
                  f"{len(prompts)} training prompts (template {args.template}), block {args.block_size}, "
                  f"{args.max_new_tokens} new tokens, {args.dtype} on {args.device} ({args.threads} threads); "
                  f"one untimed warm-up prompt first.\n\n{md}", table)


if __name__ == "__main__":
    main()
