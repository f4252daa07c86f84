# python -m pardec.benchmarks.jacobi_forcing --base runs/default_base/hf \
#   --round1 runs/jacobi_forcing_default/stages/00-round1/hf --round2 runs/jacobi_forcing_default/stages/01-round2/hf
"""Jacobi Forcing on the embedded default: AR greedy vs Jacobi decoding before and after each
progressive-distillation round vs multi-block decoding with rejection recycling; and the training
cost of the packed single-forward loss against naive per-block forwards.

Decoding (table 1). All rows decode the same held-out problems (the synthetic test split) one
sample at a time (batch 1) in one process, one after the other, so their TPS are comparable; TPS
ratios are to AR greedy of the base measured in this run (every row first decodes two problems
untimed, as a warm-up). Each model's AR greedy output is decoded once (its own row) and is the
reference of that model's parallel rows. Columns:

* accuracy: exact final answer (``#### n``);
* = own AR greedy: fraction of samples whose tokens equal the SAME model's AR greedy output
  exactly (Jacobi and multi-block decoding are lossless: 100% up to numerical near-ties);
* = base AR greedy: the same against the base's AR greedy output (how far training moved the model);
* TPF = committed tokens / decoding forwards (docs/methods/conventions.md#counting), TPS and its ratio to base
  AR greedy.

Jacobi rows use the block size a checkpoint was trained at (the checkpoint metadata's ``jacobi_block_size``),
the base the round-2 block size (``--base-block-size``); drafts start from tokens drawn from the
prompt and the committed tokens (``draft_init=context``, the training noise). The multi-block rows
run the round-2 model with K blocks in flight, spawn ratio r, an n-gram pool and a verification
size (the paper's K=2, r=0.85 and verification size 4 by default;
docs/methods/jacobi_forcing.md#multi-block-decoding). The block size is a
decoding choice: round 2 is also decoded (Jacobi and multi-block) at ``--wide-block-size`` (twice
its trained block by default), as the paper does: trained at n = 32, it decodes Jacobi at n = 128
and MR at n = 64 (§4.1, §4.3).

Training efficiency (table 2). One realistic micro-batch: Jacobi trajectories of the base on
``--train-samples`` training prompts at block size ``--train-block-size``, noisy states chosen by
the progressive schedule (window ``--train-window``), packed by
``pardec.data_pipelines.jacobi_batch.build_jacobi_batch`` into rows of ``--pack-length``. Timed, each a
forward + L = L_pc + 30 L_AR + backward with the base in train mode:

* packed: ONE forward over the packed rows with the NC mask (what the trainer runs);
* naive: per sample and block j, one causal forward for the noisy block on
  ``[prompt, k_0 .. k_{j-1}, k_j]`` and one for the clean block on ``[prompt, c_0 .. c_j]``
  (2N forwards per sample of N blocks), the same loss computed from their logits.

The two losses must agree (checked, reported); ratio = naive time / packed time (median of
``--train-repeats`` after one warm-up each). Goal: ratio >= half the number of blocks
(docs/methods/jacobi_forcing.md#packing).

A real chat model, one round (the SmolLM2 CPU run): ``--round2`` is optional (without it the
multi-block and wide rows run the round-1 model), ``--wide-block-size 0`` drops the wide rows,
``--no-training-table`` skips table 2, ``--template auto`` renders prompts through the chat template,
``--device/--dtype`` place the models and ``--split val`` decodes the validation problems. Where a
forward of q tokens costs more than one of 1 (a CPU, the real model) each Jacobi row also shows its
bound TPF · t(1) / t(n) (``t`` measured on the base in this run, widths in turn, as
``pardec.benchmarks.real_model_speed``) and the share of it its TPS / AR reaches; ``--no-bound``
skips it. The multi-block rows have no bound column (their forwards' widths vary from step to step).

Block size chosen on val (``--num-val K``): before the decoding table, AR greedy of the base and of the
last round and the last round's Jacobi decoding at every n of ``--val-block-sizes`` run on the first K
val problems; n = the highest TPS among the Jacobi rows identical to the round's AR greedy on every
problem (on a CPU a wider forward costs more, so the highest TPF need not be the fastest). The decoding
table then runs the last round's Jacobi and multi-block rows, and the base's Jacobi row (unless
``--base-block-size``), at that n; the JSON adds ``validation``, ``chosen_block_size``, ``choice_rule`` and
``chosen_labels`` (the chosen Jacobi and multi-block rows' labels). ``--choose-multiblock-n``: the val
phase also runs the last round's multi-block at every n, and multi-block's n is chosen on its own by the
same rule among those rows (``chosen_multiblock_block_size``, ``multiblock_choice_rule``; without it
multi-block decodes at Jacobi's n, and ``chosen_multiblock_block_size`` is that n).

``--chunk-dir DIR``: the test rows decoded ``--chunk-size`` problems at a time, every row on each chunk in turn
(so a drift of the machine's speed reaches a row and its reference alike), each chunk saved in DIR and skipped
when the same command runs again; the table of the problems done so far is rewritten after every chunk
(``pardec.benchmarks.chunks``). Each problem's draft seed follows its number in the split, so the chunks decode
what one run decodes. The val sweep with the n it chose (``validation.json``) and the bound's latencies
(``bound.json``, ``pardec.benchmarks.chunks.kept_bound``) are kept beside the chunks and read on restart: a
restart decodes the same rows, and a table read back from its chunks is the same table. Table 2 times training
steps, not decoding: chunks need ``--no-training-table``.

A shorter test table (``--skip-rows``): ``base-jacobi`` drops the untrained base's Jacobi row,
``multiblock`` every multi-block row; what is left still answers accuracy, losslessness (each round's
Jacobi against its own AR greedy), TPF and TPS / base AR. The markdown names the rows skipped, the JSON
records them (``skipped_rows``) and ``chosen_labels`` names only rows that ran (with ``multiblock``
skipped, no ``chosen_multiblock_block_size`` or ``multiblock_choice_rule`` either).

Writes ``benchmarks/results/jacobi_forcing.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from pardec.benchmarks.chunks import add_chunk_args, decode_all, decode_rows, kept_bound, kept_in, progress_note
from pardec.benchmarks.common import (
    RESULTS,
    add_bound_args,
    add_runtime_args,
    add_split_arg,
    fastest_lossless,
    identical,
    invoked_command,
    or_dash,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.common.errors import ConfigError
from pardec.data_pipelines.config import DataConfig
from pardec.data_pipelines.jacobi_batch import build_jacobi_batch
from pardec.data_pipelines.jacobi_noise import select_noisy_blocks
from pardec.data_pipelines.jacobi_trajectories import CollectSettings, collect_one
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import format_prompt_ids
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.jacobi import resolve_block_size
from pardec.inference.metrics import compute_metrics
from pardec.losses.jacobi import jacobi_forcing_loss
from pardec.methods.base import forward_logits

AR_WEIGHT = 30.0  # pardec/recipes/experiment/jacobi_forcing_default.yaml
SKIPPABLE_ROWS = ("base-jacobi", "multiblock")
VALIDATION_FILE = "validation.json"  # beside the chunks: the --num-val sweep and the n it chose
Row = tuple[str, str, dict]  # (label, model key, decoder config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--round1", required=True, help="Jacobi Forcing round-1 export")
    p.add_argument("--round2", default=None, help="Jacobi Forcing round-2 export (without it: round 1 is the last)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--base-block-size", type=int, default=None,
                   help="Jacobi block size for the base (default: the round-2 block size)")
    p.add_argument("--wide-block-size", type=int, default=None,
                   help="a decode-time block wider than round 2's trained one, for extra Jacobi and multi-block "
                        "rows of round 2 (default: twice the round-2 block size; 0 = no extra rows)")
    p.add_argument("--num-blocks", type=int, default=2, help="multi-block K")
    p.add_argument("--spawn-ratio", type=float, default=0.85, help="multi-block r")
    p.add_argument("--ngram-pool-size", type=int, default=4)
    p.add_argument("--verification-size", type=int, default=4)
    # The timed micro-batch; defaults = round 1 of pardec/recipes/experiment/jacobi_forcing_default.yaml.
    p.add_argument("--train-samples", type=int, default=16, help="prompts in the timed micro-batch")
    p.add_argument("--train-block-size", type=int, default=8)
    p.add_argument("--train-window", type=int, default=4)
    p.add_argument("--train-max-new-tokens", type=int, default=64)
    p.add_argument("--pack-length", type=int, default=512)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--no-training-table", action="store_true", help="skip table 2 (the packed-loss timing)")
    add_split_arg(p)
    p.add_argument("--num-val", type=int, default=0,
                   help="choose the last round's block size n on this many val problems first (highest TPS, lossless)")
    p.add_argument("--val-block-sizes", type=int, nargs="+", default=[4, 8, 16], help="the n tried on val")
    p.add_argument("--choose-multiblock-n", action="store_true",
                   help="val also runs multi-block at every n and chooses its n on its own (default: Jacobi's n)")
    p.add_argument("--skip-rows", nargs="+", default=[], choices=SKIPPABLE_ROWS,
                   help="leave these rows out of the tables: the untrained base's Jacobi row, every multi-block row")
    add_runtime_args(p)
    add_bound_args(p, "n")
    add_chunk_args(p)
    p.add_argument("--out", default=str(RESULTS / "jacobi_forcing"))
    return p.parse_args(argv)


def trained_block_size(model, path: str) -> int:
    try:
        return resolve_block_size(model, None)
    except ConfigError as err:
        sys.exit(f"{path}: {err}")


# ---------------------------------------------------------------------------------------------
# Table 1: decoding
# ---------------------------------------------------------------------------------------------


ROUND_NAME = {"round1": "round 1", "round2": "round 2"}


def jacobi_label(n: int, which: str, trained: int | None) -> str:
    """``Jacobi n=8 (round 1)``; a round decoded at another n than it was trained at says so."""
    if which == "base":
        return f"Jacobi n={n} (base, untrained)"
    return f"Jacobi n={n} ({ROUND_NAME[which]}" + ("" if n == trained else f", trained at n={trained}") + ")"


def ar_config(args) -> dict:
    return {"name": "ar", "max_new_tokens": args.max_new_tokens, "batch_size": 1, "cuda_graphs": args.cuda_graphs}


def jacobi_config(args, n: int) -> dict:
    return {"name": "jacobi", "block_size": n, "draft_init": "context", "max_new_tokens": args.max_new_tokens,
            "batch_size": 1, "cuda_graphs": args.cuda_graphs}


def multiblock_row(args, n: int, last: str) -> tuple[str, str, dict]:
    label = (f"Multi-block + recycling n={n} K={args.num_blocks} r={args.spawn_ratio} "
             f"pool={args.ngram_pool_size} verify={args.verification_size} ({ROUND_NAME[last]})")
    return label, last, {"name": "multiblock", "block_size": n, "num_blocks": args.num_blocks,
                         "spawn_ratio": args.spawn_ratio, "ngram_pool_size": args.ngram_pool_size,
                         "verification_size": args.verification_size, "draft_init": "context",
                         "max_new_tokens": args.max_new_tokens, "batch_size": 1, "cuda_graphs": args.cuda_graphs}


def decoding_rows(args, trained: dict[str, int], chosen: int | None,
                  chosen_multiblock: int | None = None) -> list[tuple[str, str, dict]]:
    """(label, model key, decoder config) of table 1, in order: each model's AR greedy before its
    parallel rows. The last round decodes at ``chosen`` (its trained n when None), its multi-block row
    at ``chosen_multiblock`` (``chosen`` when None)."""
    rounds = list(trained)
    last = rounds[-1]
    n_last = chosen or trained[last]
    base_n = args.base_block_size or n_last
    wide_n = 2 * trained[last] if args.wide_block_size is None else args.wide_block_size
    ar = ar_config(args)
    rows = [("AR greedy (base)", "base", ar), (jacobi_label(base_n, "base", None), "base", jacobi_config(args, base_n))]
    for r in rounds:
        n = n_last if r == last else trained[r]
        rows += [(f"AR greedy ({ROUND_NAME[r]})", r, ar), (jacobi_label(n, r, trained[r]), r, jacobi_config(args, n))]
    rows.append(multiblock_row(args, chosen_multiblock or n_last, last))
    if wide_n:
        rows += [(jacobi_label(wide_n, last, trained[last]), last, jacobi_config(args, wide_n)),
                 multiblock_row(args, wide_n, last)]
    return [row for row in rows if not skipped(args, row)]


def skipped(args, row: tuple[str, str, dict]) -> bool:
    """Whether ``--skip-rows`` leaves this (label, model key, decoder config) row out."""
    _, which, decoder = row
    return (("base-jacobi" in args.skip_rows and which == "base" and decoder["name"] == "jacobi")
            or ("multiblock" in args.skip_rows and decoder["name"] == "multiblock"))


def validation_rows_for_n(args, trained: dict[str, int]) -> list[tuple[str, str, dict]]:
    """The val phase: AR greedy of the base and of the last round, then the last round's Jacobi at
    every n of ``--val-block-sizes`` (and, ``--choose-multiblock-n``, its multi-block at every n)."""
    last = list(trained)[-1]
    ar = ar_config(args)
    multiblock = [multiblock_row(args, n, last) for n in args.val_block_sizes] if args.choose_multiblock_n else []
    return [("AR greedy (base)", "base", ar), (f"AR greedy ({ROUND_NAME[last]})", last, ar),
            *[(jacobi_label(n, last, trained[last]), last, jacobi_config(args, n)) for n in args.val_block_sizes],
            *multiblock]


def choose_block_size(val_table: list[dict], decoder: str = "jacobi") -> tuple[int, str]:
    """(n, the rule that chose it): the fastest ``decoder`` row (jacobi or multiblock) of a trained round
    identical to its AR greedy on val (:func:`pardec.benchmarks.common.fastest_lossless`)."""
    best, rule = fastest_lossless(
        [r for r in val_table if r["decoder_config"]["name"] == decoder and r["model"] != "base"],
        {"jacobi": "Jacobi rows", "multiblock": "multi-block rows"}[decoder])
    return best["decoder_config"]["block_size"], rule


def table_of(rows: list[Row], records: dict[str, list[dict]], latency: dict) -> list[dict]:
    """One table row per entry of ``rows`` from its (pooled) records, in order: each model's AR greedy comes
    before its parallel rows (their reference), the first row is the base's (the TPS ratios' reference)."""
    table, own_ar = [], {}
    for label, which, decoder in rows:
        recs = records[label]
        m = compute_metrics(recs, decoder["name"] == "ar")
        if decoder["name"] == "ar":
            own_ar[which] = recs
        row = {
            "decoder": label, "model": which, "decoder_config": decoder, "accuracy": m["accuracy"],
            "identical_to_own_ar": identical(recs, own_ar[which]),
            "identical_to_base": identical(recs, own_ar["base"]),
            "tpf": m["tpf"], "tps": m["tps"], "tps_ratio": m["tps"] / table[0]["tps"] if table else 1.0,
            "mean_new_tokens": m["mean_new_tokens"], "eos_rate": m["eos_rate"], "num_samples": m["num_samples"],
        }
        n = decoder["block_size"] if decoder["name"] == "jacobi" else None
        row["bound"] = m["tpf"] * latency[1] / latency[n] if n and latency else None
        row["share_of_bound"] = row["tps_ratio"] / row["bound"] if row["bound"] else None
        table.append(row)
    return table


def measure(args, models, eval_rows, rows: list[Row], latency: dict) -> list[dict]:
    """The table of ``rows`` on ``eval_rows`` decoded in one go (the validation rows)."""
    table = table_of(rows, decode_rows(models, eval_rows, rows, args.template, set()), latency)
    for row in table:
        print(json.dumps(row), flush=True)
    return table


def chunk_fingerprint(args, rows: list[Row]) -> dict:
    """What the chunks are made by (pardec.benchmarks.chunks: a chunk of another setting is refused)."""
    return {"benchmark": "jacobi_forcing", "base": args.base, "round1": args.round1, "round2": args.round2,
            "split": args.split, "template": args.template, "device": args.device, "dtype": args.dtype,
            "threads": args.threads, "rows": [[label, decoder] for label, _, decoder in rows]}  # labels name the model


# ---------------------------------------------------------------------------------------------
# Table 2: packed single forward vs naive per-block forwards
# ---------------------------------------------------------------------------------------------


def training_samples(args, model, tok) -> list[dict]:
    """Training examples as the recipe builds them: base trajectories + progressive noise schedule."""
    data_cfg = OmegaConf.structured(DataConfig)
    data_cfg.max_train_samples = args.train_samples
    rows = load_raw_split(data_cfg, "train")
    settings = CollectSettings(block_size=args.train_block_size, max_new_tokens=args.train_max_new_tokens,
                               eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    samples = []
    with torch.no_grad():
        for i, row in enumerate(rows):
            traj = collect_one(model, i, format_prompt_ids(tok, row["prompt"], "plain"), settings)
            noisy = select_noisy_blocks(traj["states"], traj["fixed_points"], traj["valid_lens"],
                                        args.train_window, "progressive", (0, i))
            samples.append({"prompt_ids": traj["prompt_ids"], "noisy_blocks": noisy,
                            "clean_blocks": traj["fixed_points"], "valid_lens": traj["valid_lens"]})
    return samples


def packed_loss(model, batch) -> torch.Tensor:
    logits = forward_logits(model, batch)  # [r, s, V]
    total, _ = jacobi_forcing_loss(logits, batch["labels"], batch["pc_student_index"], batch["pc_teacher_index"],
                                   batch["n_blocks"], AR_WEIGHT)
    return total


def naive_loss(model, samples: list[dict], n: int) -> tuple[torch.Tensor, int]:
    """The same L = L_pc + w * L_AR from 2N plain causal forwards per sample (batch 1 each).

    Block j: noisy forward on [prompt, k_0..k_{j-1}, k_j], clean forward on [prompt, c_0..c_j].
    L_pc: KL(clean || noisy, teacher detached) at offsets from the block's first mismatch to its last
    offset with a prediction (n - 1; valid_len - 2 in the EOS block), summed over the batch and divided
    by its number of blocks. L_AR: the prompt's last logit (from block 0's clean forward) predicts the
    first answer token, clean slot (j, o) the answer token j*n + o + 1 when it exists; token mean.
    Returns the loss and the number of forwards.
    """
    device = next(model.parameters()).device

    def run(seq: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0]  # [len, V]

    kl_sum, blocks, forwards = 0.0, 0, 0
    ce_logits, ce_targets = [], []
    for s in samples:
        prompt, valid = list(s["prompt_ids"]), s["valid_lens"]
        p = len(prompt)
        answer = [t for c, v in zip(s["clean_blocks"], valid) for t in c[:v]]
        for j, (k, c, v) in enumerate(zip(s["noisy_blocks"], s["clean_blocks"], valid)):
            blocks += 1
            noisy_ctx = [t for b in s["noisy_blocks"][:j] for t in b]
            clean_ctx = [t for b in s["clean_blocks"][:j] for t in b]
            noisy = run(prompt + noisy_ctx + list(k))[-n:]  # [n, V]
            clean_all = run(prompt + clean_ctx + list(c))  # [P + (j+1)n, V]
            forwards += 2
            clean = clean_all[-n:]  # [n, V]
            if j == 0:
                ce_logits.append(clean_all[p - 1 : p])
                ce_targets.append(answer[0])
            for o in range(n):
                if j * n + o + 1 < len(answer):
                    ce_logits.append(clean[o : o + 1])
                    ce_targets.append(answer[j * n + o + 1])
            mismatches = [o for o in range(v) if k[o] != c[o]]
            if mismatches:
                last = n - 1 if v == n else v - 2
                offsets = torch.arange(mismatches[0], last + 1, device=device)
                log_t = F.log_softmax(clean[offsets].detach().float(), -1)
                log_s = F.log_softmax(noisy[offsets].float(), -1)
                kl_sum = kl_sum + (log_t.exp() * (log_t - log_s)).sum()
    l_pc = kl_sum / blocks
    l_ar = F.cross_entropy(torch.cat(ce_logits).float(), torch.tensor(ce_targets, device=device))
    return l_pc + AR_WEIGHT * l_ar, forwards


def timed(fn, repeats: int, model) -> tuple[float, float]:
    """(median seconds of forward + loss + backward, loss value); one untimed warm-up first."""
    times, value = [], None
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = fn()
        loss.backward()
        elapsed = time.perf_counter() - start
        value = float(loss.detach())
        if i:
            times.append(elapsed)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), value


def efficiency_table(args, model, tok) -> dict:
    samples = training_samples(args, model, tok)
    n = args.train_block_size
    batch = build_jacobi_batch(samples, block_size=n, pack_length=args.pack_length, pad_token_id=tok.pad_token_id,
                               mask="nc", window=args.train_window)
    blocks = [len(s["clean_blocks"]) for s in samples]
    model.train()
    try:
        packed_s, packed_value = timed(lambda: packed_loss(model, batch), args.train_repeats, model)
        naive_holder = {}

        def naive():
            loss, naive_holder["forwards"] = naive_loss(model, samples, n)
            return loss

        naive_s, naive_value = timed(naive, args.train_repeats, model)
    finally:
        model.eval()
    ratio = naive_s / packed_s
    mean_blocks = sum(blocks) / len(blocks)
    row = {
        "samples": len(samples), "block_size": n, "window": args.train_window,
        "blocks_per_sample_mean": mean_blocks, "blocks_per_sample_max": max(blocks), "blocks_total": sum(blocks),
        "packed_rows": int(batch["input_ids"].shape[0]), "pack_length": args.pack_length,
        "packed_forwards": 1, "naive_forwards": naive_holder["forwards"],
        "packed_s": packed_s, "naive_s": naive_s, "ratio": ratio, "goal": mean_blocks / 2,
        "meets_goal": ratio >= mean_blocks / 2,
        "packed_loss": packed_value, "naive_loss": naive_value,
        "loss_rel_diff": abs(packed_value - naive_value) / max(abs(naive_value), 1e-12),
    }
    print(json.dumps(row), flush=True)
    if row["loss_rel_diff"] > 1e-3:
        sys.exit(f"packed loss {packed_value} != naive loss {naive_value}: the comparison is not like for like")
    return row


# ---------------------------------------------------------------------------------------------


def markdown(table: list[dict], bound: bool) -> list[str]:
    lines = ["| decoder | accuracy | = own AR greedy | = base AR greedy | TPF | TPS | TPS / base AR |"
             + (" bound TPF·t(1)/t(n) | share of bound |" if bound else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if bound else "")]
    return lines + [
        f"| {r['decoder']} | {or_dash(r['accuracy'], '.1%')} | {r['identical_to_own_ar']:.1%} | "
        f"{r['identical_to_base']:.1%} | {r['tpf']:.2f} | {r['tps']:.1f} | {r['tps_ratio']:.2f}x |"
        + (f" {or_dash(r['bound'], '.2f')} | {or_dash(r['share_of_bound'], '.0%')} |" if bound else "")
        for r in table
    ]


def efficiency_lines(e: dict, repeats: int) -> list[str]:
    """Table 2's markdown."""
    return [
        "",
        f"Training step (forward + L_pc + {AR_WEIGHT:g} L_AR + backward, base model, median of {repeats}): "
        f"one micro-batch of {e['samples']} samples, n={e['block_size']}, w={e['window']}.",
        "",
        "| blocks / sample (mean, max) | packed: forwards, rows x length, time | naive per-block: forwards, time "
        "| speed-up | goal (>= blocks / 2) | loss packed / naive |",
        "|---|---|---|---|---|---|",
        f"| {e['blocks_per_sample_mean']:.2f}, {e['blocks_per_sample_max']} | 1, {e['packed_rows']} x "
        f"{e['pack_length']}, {e['packed_s'] * 1e3:.0f} ms | {e['naive_forwards']}, {e['naive_s'] * 1e3:.0f} ms | "
        f"{e['ratio']:.1f}x | {e['goal']:.2f} ({'met' if e['meets_goal'] else 'NOT met'}) | "
        f"{e['packed_loss']:.4f} / {e['naive_loss']:.4f} |",
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_val and args.split == "val":
        raise SystemExit("--num-val chooses n on val to report on test: drop --split val")
    if args.choose_multiblock_n and "multiblock" in args.skip_rows:
        raise SystemExit("--choose-multiblock-n chooses the n of rows that --skip-rows multiblock leaves out: drop one")
    if args.chunk_dir and not args.no_training_table:
        raise SystemExit("--chunk-dir decodes table 1 in chunks; table 2 times training steps, not decoding: "
                         "add --no-training-table")
    torch.set_num_threads(args.threads)
    eval_rows = split_rows(args.split, args.num_samples)

    names = ["base", "round1"] + (["round2"] if args.round2 else [])
    models = {name: load_checkpoint(getattr(args, name), device=args.device, dtype=args.dtype) for name in names}
    trained = {r: trained_block_size(models[r][0], getattr(args, r)) for r in names[1:]}
    checkpoints = [getattr(args, name) for name in names]
    val_rows = validation_rows_for_n(args, trained) if args.num_val else []
    widths = [1, *sorted({d["block_size"] for _, _, d in [*val_rows, *decoding_rows(args, trained, None)]
                          if d["name"] == "jacobi"})]
    latency, note = kept_bound(args, "jacobi_forcing", models["base"][0], widths)
    bound_note = f" t(q) {note}." if note else ""
    validation, chosen, rule, chosen_multiblock, multiblock_rule, kept_note = None, None, None, None, None, ""
    if args.num_val:

        def sweep() -> dict:
            table = measure(args, models, validation_rows(args.num_val), val_rows, latency)
            return {"table": table, "choice": choose_block_size(table),
                    "multiblock_choice": choose_block_size(table, "multiblock") if args.choose_multiblock_n else None}

        # chosen once per chunk directory: a restart decodes the same rows
        val_fingerprint = {**chunk_fingerprint(args, val_rows), "split": "val", "num_val": args.num_val}
        kept, note = kept_in(args.chunk_dir, VALIDATION_FILE, val_fingerprint, sweep, checkpoints)
        kept_note = f", {note}" if note else ""
        validation, (chosen, rule) = kept["table"], kept["choice"]
        chosen_multiblock, multiblock_rule = kept["multiblock_choice"] or (None, None)
    rows = decoding_rows(args, trained, chosen, chosen_multiblock)
    command, warmed, bound = invoked_command("pardec.benchmarks.jacobi_forcing", argv), set(), not args.no_bound

    def write_table(records: dict[str, list[dict]], done: int, machine: dict) -> None:
        table = table_of(rows, records, latency)
        for row in table:
            print(json.dumps(row), flush=True)
        efficiency = None
        if not args.no_training_table and done == len(eval_rows):  # after the decoding (no chunks: refused)
            efficiency = efficiency_table(args, *models["base"])
        lines = []
        if validation is not None:
            multiblock_choice = (f"; multi-block's n chosen here: {chosen_multiblock}, {multiblock_rule}"
                                 if chosen_multiblock else "")
            lines += [f"Validation split ({args.num_val} problems of the generator's val split{kept_note}; n chosen "
                      f"here: {chosen}, {rule}{multiblock_choice}):", "", *markdown(validation, bound), "",
                      f"{split_label(args.split).capitalize()}:", ""]
        lines += markdown(table, bound)
        lines.append(f"\n{done} {args.split} problems, batch 1, {args.dtype} on {args.device}, "
                     f"<= {args.max_new_tokens} new tokens, template {args.template}"
                     f"{progress_note(args.chunk_dir, args.chunk_size, done, len(eval_rows))}."
                     + (f" Rows skipped (--skip-rows): {', '.join(args.skip_rows)}." if args.skip_rows else "")
                     + bound_note)
        lines += [] if efficiency is None else efficiency_lines(efficiency, args.train_repeats)
        md = "\n".join(lines)
        print(md, flush=True)
        payload = {"command": command, "decoding": table, "training_efficiency": efficiency,
                   "skipped_rows": args.skip_rows}
        if validation is not None:
            last = names[-1]
            labels = {"jacobi": jacobi_label(chosen, last, trained[last]),
                      "multiblock": multiblock_row(args, chosen_multiblock or chosen, last)[0]}
            ran = {r["decoder"] for r in table}
            payload.update(validation=validation, chosen_block_size=chosen, choice_rule=rule,
                           chosen_labels={kind: label for kind, label in labels.items() if label in ran})
            if "multiblock" not in args.skip_rows:  # no n for a decoder that did not run
                payload.update(chosen_multiblock_block_size=chosen_multiblock or chosen,
                               multiblock_choice_rule=multiblock_rule)
        write_results(args.out, command, md, payload, machine=machine)

    decode_all(eval_rows, args.chunk_dir, args.chunk_size, chunk_fingerprint(args, rows),
               lambda problems, first: decode_rows(models, problems, rows, args.template, warmed, first),
               write_table, checkpoints)


if __name__ == "__main__":
    main()
