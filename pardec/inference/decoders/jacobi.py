"""Jacobi decoding (greedy, lossless) with a KV cache of the committed tokens.

References: Jacobi Forcing, "Fast and Accurate Causal Parallel Decoding using Jacobi Forcing",
arXiv:2512.14681, §2.1 Eq. (3)-(4) (Jacobi fixed-point iteration, block by block);
docs/methods/jacobi_forcing.md#jacobi-decoding.

A *block* covers ``n`` output positions ``[S, S + n)`` (the last block of a sample is cut at
``max_new_tokens``). Its state ``y = (y_1 .. y_n)`` starts from a draft ``y^(0)`` and follows Eq. (3):
``y_i <- argmax p(. | x, y_<i)`` for every i at once, which is ONE causal forward over
``[anchor, y_1 .. y_{n-1}]`` where the *anchor* is the last committed token (the prompt's last
token at the start). These are the n query tokens of the trajectory convention
("[first correct token] + n-1 drafts", docs/methods/jacobi_forcing.md#trajectory-collection); ``y_n`` is
never an input (nothing in the block depends on it), so only its update matters.

Per forward (``P`` = position of the next token to commit, the anchor sits at ``P - 1``; the KV
cache holds exactly the prompt and the committed tokens *except* the anchor, as in AR decoding):

1. Input ``[anchor, y_1 .. y_{w-1}]`` at positions ``P-1 .. P+w-2``, ``w`` = uncommitted positions
   left in the block; plain causal attention over the cache and the input.       # [1, w]
2. ``g = argmax`` of the w logits: ``g_i`` is the greedy token for position ``P + i`` given the
   committed prefix and ``y_<i``. ``g_0`` depends on committed tokens only, so it is exact.
3. Accept the longest converged prefix: ``k`` = the longest prefix with ``y_i == g_i``; commit
   ``g_0 .. g_k`` (``min(k + 1, w)`` tokens, >= 1). Each committed ``g_i`` (i <= k) is conditioned
   on committed tokens only, hence equals AR greedy: the decoder is lossless by construction.
   Stop after the first EOS among them, or at ``max_new_tokens``.
4. Crop the KV cache to the committed length: the anchor and the accepted inputs
   ``y_1 .. y_{c-1}`` (equal to the committed ``g_0 .. g_{c-2}``) keep their entries, the
   rejected tail is dropped. The new anchor is ``g_{c-1}`` (not yet in the cache).
5. The block's uncommitted positions take ``g_c ..`` as their next state (the Jacobi update).
   When the block is complete, the next block starts from a fresh draft.

Draft initialisation (``draft_init``, seeded per sample by ``seed`` through ``random.Random``):

- ``context`` (default): each draft token is drawn uniformly from the prompt and the tokens
  committed so far; this is the noise the Jacobi Forcing trajectories are collected from
  (docs/methods/jacobi_forcing.md#trajectory-collection), so a trained model sees its training distribution
  of draft states;
- ``repeat``: the token just before the block, repeated (deterministic).

The forwards run through ``pardec.inference.decoders.decode_steps`` (a ``DynamicCache`` by default;
``cuda_graphs: true``: a static cache with each block width ``w`` captured once as a CUDA graph, batch 1).

Counting (``pardec.inference.decoders.base``): every forward of the loop is counted; each commits at
least one token, so a block takes at most n forwards and no iteration cap is needed (the loop
spends at most ``max_new_tokens`` forwards). TPF <= n; a model whose drafts are already the
fixed point reaches TPF = n.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from pardec.common.config_fields import Choice, ranged
from pardec.common.constants import METADATA_KEY
from pardec.common.errors import ConfigError
from pardec.common.metadata import AR, MASKED_AR, CheckpointMetadata
from pardec.inference.decoders.base import DecoderConfig, DecodeResult, LoopTimer, PerSampleDecoder, model_device
from pardec.inference.decoders.decode_steps import StepsPool, causal_block


class DraftInit(Choice):
    """context: uniform draws from prompt + committed tokens; repeat: repeat the preceding token."""

    context = "context"
    repeat = "repeat"



@dataclass
class JacobiDecoderConfig(DecoderConfig):
    name: str = "jacobi"
    # n: output positions per block (= query tokens per forward at the start of a block);
    # null = the checkpoint's recorded jacobi_block_size (the n of its last training round).
    block_size: Optional[int] = ranged(None, ge=1)
    draft_init: DraftInit = DraftInit.context
    # Each step width as a CUDA graph over a static cache (pardec.inference.decoders.decode_steps; on a
    # GPU, so that TPS follows TPF; elsewhere the same static steps run eagerly).
    cuda_graphs: bool = False


def resolve_block_size(model, block_size: int | None) -> int:
    """``block_size`` if given, else the checkpoint's recorded ``jacobi_block_size``."""
    if block_size is None:
        block_size = CheckpointMetadata.of_model(model).jacobi_block_size
        if block_size is None:
            raise ConfigError(
                f"config key 'decoder.block_size' is null and the checkpoint records no "
                f"'{METADATA_KEY}.jacobi_block_size' in its config.json (not a Jacobi Forcing export): "
                "set decoder.block_size=n"
            )
    return block_size


def init_draft(mode: str, rng: random.Random, context: Sequence[int], previous: int, length: int) -> list[int]:
    """``length`` draft tokens for a new block.

    ``context`` = prompt + committed tokens (``context`` mode draws from it uniformly with ``rng``);
    ``previous`` = the token just before the block (``repeat`` mode repeats it).
    """
    if mode == "repeat":
        return [previous] * length
    return [context[rng.randrange(len(context))] for _ in range(length)]


def converged_prefix(draft: Sequence[int], pred: Sequence[int]) -> int:
    """Length of the longest prefix on which ``draft`` and ``pred`` agree."""
    k = 0
    for d, p in zip(draft, pred):
        if d != p:
            break
        k += 1
    return k


def truncate_at_eos(tokens: list[int], eos_token_ids: Collection[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first EOS, and whether there was one."""
    for i, tok in enumerate(tokens):
        if tok in eos_token_ids:
            return tokens[: i + 1], True
    return tokens, False


class JacobiDecoder(PerSampleDecoder):
    name = "jacobi"
    # The checkpoint kinds it decodes (pardec.common.metadata.CHECKPOINT_KINDS): every causal next-token LM.
    checkpoint_kinds = (AR, MASKED_AR)

    def __init__(self, cfg: JacobiDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.steps = StepsPool(cfg.cuda_graphs)

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        if not prompt:
            raise ValueError("Jacobi decoding needs at least one prompt token (got an empty prompt)")
        cfg = self.cfg
        block_size = resolve_block_size(model, cfg.block_size)
        device = model_device(model)
        rng = random.Random(seed)
        masks: dict[int, torch.Tensor] = {}  # causal mask per width, built once (no host work per step)
        steps = self.steps.get(model, len(prompt) + cfg.max_new_tokens + block_size, block_size)
        steps.reset(prompt[:-1])  # the last prompt token is the first anchor
        anchor, position = prompt[-1], len(prompt)  # anchor at position - 1, not in the cache
        budget_end = len(prompt) + cfg.max_new_tokens
        tokens: list[int] = []
        draft: list[int] = []  # state of the uncommitted positions [position, block end)
        forwards = blocks = 0
        hit_eos = False

        with LoopTimer(device) as timer:
            while position < budget_end and not hit_eos:
                if not draft:  # a new block
                    length = min(block_size, budget_end - position)
                    draft = init_draft(cfg.draft_init, rng, list(prompt) + tokens, anchor, length)
                    blocks += 1
                # 1. one causal forward over [anchor, y_1 .. y_{w-1}]
                width, cached = len(draft), steps.length  # the cache ends just before the anchor
                if width not in masks:
                    masks[width] = causal_block(width, model.dtype, device)
                logits = steps.forward([anchor] + draft[:-1], masks[width])  # [w, V]
                forwards += 1
                # 2. greedy update: pred[i] is the token for position `position + i`
                pred = logits.argmax(dim=-1).tolist()  # [w]
                # 3. accept the longest converged prefix plus the first exact token after it
                accepted = min(converged_prefix(draft, pred) + 1, width)
                new, hit_eos = truncate_at_eos(pred[:accepted], eos_token_ids)
                tokens += new
                # 4. keep the KV of the anchor and the accepted inputs, drop the rejected tail
                steps.crop(cached + accepted)
                # 5. Jacobi update of the block's remaining positions
                anchor, position, draft = pred[accepted - 1], position + accepted, pred[accepted:]

        return DecodeResult(
            tokens=tokens,
            forwards=forwards,
            committed=len(tokens),
            wall_time_s=timer.elapsed,
            hit_eos=hit_eos,
            stats={"blocks": blocks},
        )
