"""Saber: revocable MDM decoding with adaptive acceleration and backtracking-enhanced remasking.

References: arXiv:2510.18165 (Dong et al. 2025, Saber: An Efficient Sampling with Adaptive Acceleration and
Backtracking Enhanced Remasking for Diffusion Language Model; official code github.com/zhaoyMa/Saber,
``decoding.py:generate_with_saber``, read for the values below). One of COVER's revocable baselines
(arXiv:2602.06161 §6).

Same fixed length, semi-AR blocks, named errors, EOS stop and counting as the other MDM decoders
(:mod:`pardec.inference.decoders.mdm_common`); no cache (one full forward per step, as the official code). Greedy
(temperature 0, the paper's setting).

**Confidence** of a block position j in a step's forward (read at output j - 1, the logit shift): masked, the
softmax probability of its argmax token; decoded, the probability of the token it holds.

**One step** (current block ``[s, e)``):

1. *Adaptive acceleration*: threshold ``tau`` = mean, over the answer positions decoded now (the paper's
   U_{t-1}, earlier blocks included), of the confidence each had when it was last unmasked; ``tau = 1`` (the
   paper's c_max) while none is. Draft D_t = the block's masked positions with confidence > ``tau``; when fewer
   than ``min_tokens`` (the paper's n, official 2) pass, the ``min_tokens`` most confident masked ones (all
   when fewer remain). As decoded context makes the model surer, more positions pass per step.
2. *Backtracking-enhanced remasking*: each position of the block decoded *before* this step has a drop
   ``c(previous step) - c(this step)``; the ``mu_t`` largest drops are re-masked (ties: lower offset),
   ``mu_t = min(max(min_tokens // 2, ceil(|D_t| / remask_divisor)), |D_t| - 1)`` (official, divisor 8), so
   the block gains at least one decoded position per step and a block of k positions takes at most k steps.
   No re-masking in the step whose drafts complete the block (official).

**Statistics** as WINO's (:mod:`pardec.inference.decoders.wino`): ``steps``, ``revisions`` (= ReMasks),
``flip_flops``, ``effective_revisions``, ``tokens_per_step``; ``summarize`` aggregates them.

**Deviations / choices** (where the official code differs, or the paper leaves the detail open):

- Re-mask candidates are the block's positions decoded before the step. The official code also ranks the
  tokens drafted in the same step (their "drop" compares two predictions made while they were masked) and
  every decoded position of earlier blocks (its configs use one block of the whole length, where that cannot
  arise).
- A decoded position's confidence is the probability of the token it holds; the official LLaDA code uses the
  argmax probability at every position. Both agree while the token is still the argmax; when the model now
  prefers another token, only the former registers the drop.
- ``tau`` averages over the positions decoded now; the official code keeps the stale unmask confidence of
  re-masked positions in the mean.
- The minimum draft is capped at the block's masked count (the official ``topk`` would pick decoded or
  out-of-block positions) and ``mu_t`` at the number of candidates.
- Semi-AR blocks and the EOS stop as the other MDM decoders (``block_size``; the official code fills the
  whole length, block = length in its configs).
- This follows the official LLaDA script; its Dream script (``Dream/generation_utils.py``) instead re-masks the
  decoded tokens of lowest current probability, fresh drafts included, and is not offered.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from pardec.common.config_fields import ranged
from pardec.inference.decoders.base import DecodeResult, LoopTimer
from pardec.inference.decoders.mdm_common import MDMDecoder, MDMDecoderConfig, RevisionLog


@dataclass
class SaberConfig(MDMDecoderConfig):
    name: str = "saber"
    # n: when fewer masked positions pass the adaptive threshold, this many (the most confident) are drafted;
    # official 2.
    min_tokens: int = ranged(2, ge=1)
    # mu: a step re-masks max(min_tokens // 2, ceil(|drafted| / remask_divisor)) tokens, at most |drafted| - 1;
    # official 8.
    remask_divisor: int = ranged(8, ge=1)


def adaptive_threshold(unmask_conf: torch.Tensor, decoded: torch.Tensor) -> float:
    """Mean unmask-time confidence of the ``decoded`` positions (``unmask_conf``, ``decoded`` [n]); 1 if none."""
    return float(unmask_conf[decoded].double().mean()) if bool(decoded.any()) else 1.0


def saber_draft(conf: torch.Tensor, masked: torch.Tensor, threshold: float, min_tokens: int) -> list[int]:
    """Offsets drafted: masked with ``conf > threshold``; when fewer than ``min_tokens`` pass, the
    ``min_tokens`` most confident masked ones (all if fewer remain). ``conf [B]``, ``masked [B]`` bool."""
    c = conf.double().masked_fill(~masked, float("-inf"))  # [B]
    over = (c > threshold).nonzero().flatten()
    if over.numel() < min_tokens:
        over = torch.sort(c, descending=True, stable=True).indices[: min(min_tokens, int(masked.sum()))]
    return sorted(over.tolist())


def remask_count(n_drafted: int, min_tokens: int, divisor: int) -> int:
    """``mu_t = max(min_tokens // 2, ceil(n_drafted / divisor))``, at most ``n_drafted - 1`` (net progress)."""
    return max(min(max(min_tokens // 2, math.ceil(n_drafted / divisor)), n_drafted - 1), 0)


def saber_remask(drop: torch.Tensor, candidates: torch.Tensor, count: int) -> list[int]:
    """Offsets re-masked: the ``count`` ``candidates`` with the largest confidence ``drop`` (ties: lower offset).
    ``drop [B]``, ``candidates [B]`` bool."""
    k = min(count, int(candidates.sum()))
    d = drop.double().masked_fill(~candidates, float("-inf"))  # [B]
    return sorted(torch.sort(d, descending=True, stable=True).indices[:k].tolist())


def saber_step(probs: torch.Tensor, current: torch.Tensor, masked: torch.Tensor, previous: torch.Tensor,
               threshold: float, min_tokens: int, divisor: int) -> tuple[list[int], list[int]]:
    """One step's ``(drafted offsets, re-masked offsets)`` in a block: ``probs [B, V]`` this forward's
    distributions, ``current [B]`` the block's tokens, ``masked [B]``, ``previous [B]`` the confidence of each
    decoded position in the previous step's forward."""
    conf = probs.max(-1).values  # [B]
    drafted = saber_draft(conf, masked, threshold, min_tokens)
    if len(drafted) == int(masked.sum()):
        return drafted, []  # the drafts complete the block
    held = probs.gather(-1, current.clamp(max=probs.shape[-1] - 1)[:, None])[:, 0]  # [B]
    count = remask_count(len(drafted), min_tokens, divisor)
    return drafted, saber_remask(previous.double() - held.double(), ~masked, count)


class SaberDecoder(MDMDecoder):
    name = "saber"
    no_freecache_reason = "Saber runs one full forward per step"

    def __init__(self, cfg: SaberConfig, tokenizer):
        super().__init__(cfg, tokenizer)

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        run = self.start_run(model, prompt, "Saber decoding")
        info, block, device = run.info, run.block, run.x.device
        eos = set(eos_token_ids)
        log = RevisionLog()
        mask_id = info.mask_id
        p_len = run.prompt_len
        unmask_conf = torch.zeros(run.x.numel(), dtype=torch.float64, device=device)  # [n]

        with LoopTimer(device) as timer:
            for b in range(run.n_blocks):
                s, e = run.span(b)
                previous = torch.zeros(block, device=device)  # [B]; read only at positions decoded before a step
                step = 0
                while run.masked_in_block(b).any():
                    probs = torch.softmax(run.dlm_step(b, step).float(), -1)  # [B, V]
                    step += 1
                    masked = run.masked_in_block(b)  # [B]
                    decoded = run.x != mask_id  # [n]
                    decoded[:p_len] = False
                    tau = adaptive_threshold(unmask_conf, decoded)
                    drafted, remasked = saber_step(probs, run.x[s:e], masked, previous, tau, self.cfg.min_tokens,
                                                   self.cfg.remask_divisor)
                    conf, tokens = probs.max(-1)  # [B], [B]
                    for o in remasked:
                        log.remask(s + o, int(run.x[s + o]))
                        run.x[s + o] = mask_id
                    for o in drafted:
                        run.x[s + o] = tokens[o]
                        unmask_conf[s + o] = conf[o]
                        log.unmask(s + o, int(tokens[o]))
                    current = run.x[s:e].clamp(max=probs.shape[-1] - 1)
                    previous = probs.gather(-1, current[:, None])[:, 0]
                    if run.done(eos):
                        break
                if run.done(eos):
                    break

        return self.finish_run(run, eos, timer.elapsed, log)
