"""Masked-diffusion (MDM) attention: bidirectional within a sample, or block-causal (SDAR-style).

One token stream per sample (no ``[x_t | x_0]`` copy): the noisy sequence itself. Metadata, each
``[b, s]`` (built by ``pardec.data_pipelines.mdm_batch`` for training, by the MDM decoders for a step):

* ``segment_ids``: packed sample id inside the row, ``-1`` for padding;
* ``block_ids`` (block-causal only): ``0`` for every prompt token, ``1 + j // block_size`` for the
  answer token at answer offset j. Blocks are counted from the *answer start*, so the semi-AR
  decoding blocks (``block_size`` generated tokens each) are exactly the training blocks whatever
  the prompt length; the prompt is one block.

Both predicates are written once and materialised by ``pardec.masks.core`` (dense float mask for SDPA /
eager, FlexAttention ``BlockMask`` on GPU). They must always be passed explicitly: SDPA (and
transformers' mask builder) reads a missing mask as *causal*, so a bidirectional model run without
its mask silently becomes a causal one.
"""

from __future__ import annotations

import torch

from pardec.common.config_fields import Choice
from pardec.masks.core import MaskMod, within_sample

BIDIRECTIONAL = "bidirectional"
BLOCK = "block"


class MDMAttention(Choice):
    """bidirectional (inside each sample) | block (block-causal)."""

    bidirectional = BIDIRECTIONAL
    block = BLOCK


ATTENTIONS = tuple(MDMAttention)


def _everything(b, h, q_idx, kv_idx):
    return kv_idx >= 0  # broadcast to the kv axis; within_sample adds the sample clause


def bidirectional_mask(segment_ids: torch.Tensor) -> MaskMod:
    """Full attention inside each packed sample; nothing crosses samples; padding sees itself.

    Two samples ``a`` (3 tokens) and ``b`` (2 tokens) and one padding slot::

        q\\kv  a0 a1 a2 b0 b1 pad
        a0     x  x  x  .  .  .
        a1     x  x  x  .  .  .
        a2     x  x  x  .  .  .
        b0     .  .  .  x  x  .
        b1     .  .  .  x  x  .
        pad    .  .  .  .  .  x
    """
    return within_sample(segment_ids, _everything)


def block_causal_mask(segment_ids: torch.Tensor, block_ids: torch.Tensor) -> MaskMod:
    """Block-causal attention inside each packed sample: ``B(kv) <= B(q)`` (bidirectional inside a
    block, causal across blocks). One sample, prompt p0 p1 (block 0), answer a0..a3 with block
    size 2 (blocks 1 and 2)::

        q\\kv  p0 p1 a0 a1 a2 a3
        p0     x  x  .  .  .  .
        p1     x  x  .  .  .  .
        a0     x  x  x  x  .  .
        a1     x  x  x  x  .  .
        a2     x  x  x  x  x  x
        a3     x  x  x  x  x  x

    With the logit shift the query at a1 (last of block 1) predicts a2, the first token of block 2,
    which it cannot see: no target leaks.
    """

    def inside_sample(b, h, q_idx, kv_idx):
        return block_ids[b, kv_idx] <= block_ids[b, q_idx]

    return within_sample(segment_ids, inside_sample)


def answer_block_ids(positions: torch.Tensor, prompt_len: int, block_size: int) -> torch.Tensor:
    """Block id of each position of one sample: 0 in the prompt, ``1 + (p - prompt_len) // block_size``
    after it (same shape as ``positions``)."""
    offset = positions - prompt_len
    return torch.where(offset < 0, torch.zeros_like(positions), 1 + offset.clamp(min=0) // block_size)


def mdm_mask(attention: str, segment_ids: torch.Tensor, block_ids: torch.Tensor) -> MaskMod:
    """The predicate of an MDM checkpoint's ``attention`` kind (``bidirectional`` ignores ``block_ids``)."""
    if attention == BIDIRECTIONAL:
        return bidirectional_mask(segment_ids)
    if attention == BLOCK:
        return block_causal_mask(segment_ids, block_ids)
    raise ValueError(f"MDM attention must be one of {ATTENTIONS}, got {attention!r}")
