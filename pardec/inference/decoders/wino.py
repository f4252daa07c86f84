"""WINO: revocable MDM decoding, wide-in (draft with a low threshold) narrow-out (re-mask with a strict one).

Reference: WINO, Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs
(Hong et al., 2025; official code github.com/Feng-Hong/WINO-DLLM, read for the rules below). One of
COVER's revocable baselines (arXiv:2602.06161 §6).

Same fixed length, semi-AR blocks, named errors, EOS stop and counting as the other MDM decoders
(:mod:`pardec.inference.decoders.mdm_common`); no cache (one full forward per step).

**One step** (current block ``[s, e)``, k = e - s): one forward over the sequence plus k *shadow*
query rows. Shadow row o verifies block position j = s + o leave-one-out: it sees every position
the real row predicting j sees, except position j itself. With this framework's logit shift the
row predicting j is j - 1, so the shadow row carries the token ``x[j-1]`` at position id ``j - 1``
(official, no shift: a ``<|mask|>`` at position id j) and, since shadow tokens are real tokens here,
each shadow row sees no other shadow row **(choice: the official shadow rows are all masks and see
one another; here that would leak x[j] through the shadow row of j + 1)**. No real row sees a
shadow row, so the real rows' outputs are those of a plain forward.

* *Draft* (wide in): the block's masked positions with confidence > ``threshold`` (0.6), at most
  ``max_accept = min(max(int(0.7 * #masked), 5), 20)`` of them (the most confident), or the most
  confident one when none passes (the official schedule).
* *Verify* (narrow out): positions of the block decoded *before* this step whose shadow-row
  probability of their current token is < ``threshold_back`` (0.9) are re-masked, only when more
  than one token was drafted this step; when at least as many as last step's drafts (30 before the
  block's first step) would be re-masked, only the (last drafts - 1) least confident are (official).

Statistics as COVER's (:mod:`pardec.inference.decoders.cover`): ``steps``, ``revisions`` (= ReMasks),
``flip_flops``, ``effective_revisions``, ``tokens_per_step``; ``summarize`` aggregates them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from pardec.common.config_fields import ranged
from pardec.inference.decoders.base import DecodeResult, LoopTimer
from pardec.inference.decoders.mdm_common import BlockRun, MDMDecoder, MDMDecoderConfig, RevisionLog

FIRST_LAST_ACCEPT = 30  # official: the ReMask cap before a block's first step


@dataclass
class WinoConfig(MDMDecoderConfig):
    name: str = "wino"
    # Wide-in drafting threshold (strict >), official 0.6.
    threshold: float = ranged(0.6, ge=0, le=1)
    # Narrow-out: a decoded token whose leave-one-out probability is < this is re-masked, official 0.9.
    threshold_back: float = ranged(0.9, ge=0, le=1)
    # Guard (not official, whose loop has none): after this many steps in one block, re-masking stops
    # so the block finishes; null = 4 x block size. Counted in stats["remask_stopped"].
    max_block_steps: int | None = ranged(None, ge=1)


def max_accept(n_masked: int) -> int:
    """The official per-step drafting cap: 70% of the block's masked positions, within [5, 20]."""
    return min(max(int(n_masked * 0.7), 5), 20)


def wino_draft(conf: torch.Tensor, masked: torch.Tensor, threshold: float) -> list[int]:
    """Offsets drafted: masked with conf > threshold, at most :func:`max_accept`, else the top-1."""
    c = conf.float().masked_fill(~masked, float("-inf"))  # [B]
    over = (c > threshold).nonzero().flatten()
    cap = max_accept(int(masked.sum()))
    if over.numel() > cap:
        over = over[torch.sort(c[over], descending=True, stable=True).indices[:cap]]
    elif over.numel() == 0:
        over = c.argmax()[None]
    return sorted(over.tolist())


def wino_remask(conf_back: torch.Tensor, verified: torch.Tensor, threshold_back: float, n_drafted: int,
                last_accept: int) -> list[int]:
    """Offsets re-masked: verified positions with conf_back < threshold_back, only when more than one
    token was drafted; when at least ``last_accept`` qualify, the ``last_accept - 1`` least confident."""
    if n_drafted <= 1:
        return []
    c = conf_back.float().masked_fill(~verified, float("inf"))  # [B]
    low = (c < threshold_back).nonzero().flatten()
    if low.numel() >= last_accept:
        low = torch.sort(c, stable=True).indices[: last_accept - 1]
    return sorted(low.tolist())


class WinoDecoder(MDMDecoder):
    name = "wino"
    no_freecache_reason = "WINO runs one full forward per step"

    def __init__(self, cfg: WinoConfig, tokenizer):
        super().__init__(cfg, tokenizer)

    def widest_step(self, n: int, block: int) -> int:
        return n + block  # the sequence and one shadow row per block position

    def shadow_forward(self, run: BlockRun, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(real logits [B, V] predicting the block, shadow logits [B, V] verifying it)``."""
        s, e = run.span(b)
        k, n = e - s, run.x.numel()
        device = run.x.device
        rows = torch.arange(s - 1, e - 1, device=device)  # the real rows predicting the block
        ids = torch.cat([run.x, run.x[rows]])  # [n + k]
        positions = torch.cat([torch.arange(n, device=device), rows])  # [n + k]
        neg = torch.finfo(run.full_mask.dtype).min
        mask = torch.full((1, 1, n + k, n + k), neg, dtype=run.full_mask.dtype, device=device)
        mask[:, :, :n, :n] = run.full_mask[:, :, :n, :n]
        shadow = run.full_mask[0, 0, rows].clone()  # [k, n]: what the predicting rows see
        shadow[torch.arange(k, device=device), torch.arange(s, e, device=device)] = neg  # hide the verified token
        mask[0, 0, n:, :n] = shadow
        mask[0, 0, n + torch.arange(k, device=device), n + torch.arange(k, device=device)] = 0  # itself only
        logits = run.window_forward(0, ids, mask, positions)  # [n + k, V]
        return logits[s - 1 : e - 1], logits[n:]

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        run = self.start_run(model, prompt, "WINO decoding")
        info, block, device = run.info, run.block, run.x.device
        eos = set(eos_token_ids)
        log = RevisionLog()
        mask_id = info.mask_id
        step_cap = self.cfg.max_block_steps or 4 * block
        stopped = 0

        with LoopTimer(device) as timer:
            for b in range(run.n_blocks):
                s, e = run.span(b)
                last_accept = FIRST_LAST_ACCEPT
                block_steps = 0
                while run.masked_in_block(b).any():
                    real, shadow = self.shadow_forward(run, b)
                    masked = run.masked_in_block(b)  # [B]
                    conf, tokens = torch.softmax(real.float(), -1).max(-1)  # [B], [B]
                    current = run.x[s:e]  # [B]
                    p_back = torch.softmax(shadow.float(), -1)  # [B, V]
                    conf_back = p_back.gather(-1, current.clamp(max=p_back.shape[-1] - 1)[:, None])[:, 0]  # [B]
                    drafted = wino_draft(conf, masked, self.cfg.threshold)
                    remasked = wino_remask(conf_back, ~masked, self.cfg.threshold_back, len(drafted), last_accept)
                    block_steps += 1
                    if block_steps > step_cap:
                        stopped += bool(remasked)
                        remasked = []
                    for o in remasked:
                        log.remask(s + o, int(run.x[s + o]))
                        run.x[s + o] = mask_id
                    for o in drafted:
                        run.x[s + o] = tokens[o]
                        log.unmask(s + o, int(tokens[o]))
                    last_accept = len(drafted)
                    if run.done(eos):
                        break
                if run.done(eos):
                    break

        return self.finish_run(run, eos, timer.elapsed, log, remask_stopped=stopped)
