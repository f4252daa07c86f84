"""ReFusion attention: causal over the *reordered* buffer, in training and in decoding
(docs/methods/refusion.md#attention).

Training (``pardec.data_pipelines.refusion_batch``) lays a sample out as ``[prompt | clean slots in a
random order | masked slots in position order]``, every token at its original position id. The
attention rule is plain token-causal *by buffer index*, not by position: a clean slot sees the
prompt and the clean slots placed before it in the permutation, whatever their positions; a masked
slot sees the prompt, every clean slot and the masked slots before it.

The rule is simple, but the mask must always be passed explicitly: called with ``position_ids``
and no ``attention_mask``, transformers 5.x reads a jump in the position ids as the start of a new
packed sequence (measured: wrong logits on sdpa and eager), and flash-attn's varlen path would do
the same. :func:`refusion_spec` is therefore *not* marked ``causal_document``: flash-attn rejects
it, and on GPU it runs as a FlexAttention ``BlockMask`` built from the same predicate.

Decoding (``pardec.inference.decoders.refusion``) evaluates :func:`refusion_decode_mask` over
``[KV cache | step inputs]`` with per-entry *groups*: entries of group ``SHARED`` (the committed
context, plan masks, verification drafts) are plain causal; entries of a group ``g >= 0`` (one
slot being completed in parallel with others) are seen only by the same group and by ``SHARED``
queries after them. With every group ``SHARED`` the predicate is the training rule.
"""

from __future__ import annotations

import torch

from pardec.masks.core import AttentionSpec, MaskMod, causal, within_sample

SHARED = -1


def refusion_mask(segment_ids: torch.Tensor) -> MaskMod:
    """Token-causal attention by buffer index inside each packed sample (q = query, kv = key).

    ``segment_ids``: ``[b, s]`` sample id of each token in its row, ``-1`` for padding (sees only
    itself). One sample: prompt ``p0 p1``, answer of 6 tokens in three slots of k = 2
    (``A = a2 a3``, ``B = a4 a5``, ``C = a6 a7``, numbers = position ids); slots A and C clean,
    permuted to ``C, A``; slot B masked (``M``)::

        buffer   p0 p1  a6 a7  a2 a3  M4 M5   pad
        q\\kv    p0 p1  a6 a7  a2 a3  M4 M5   pad
        p0       x  .   .  .   .  .   .  .    .
        p1       x  x   .  .   .  .   .  .    .
        a6       x  x   x  .   .  .   .  .    .
        a7       x  x   x  x   .  .   .  .    .
        a2       x  x   x  x   x  .   .  .    .     (a2 sees slot C although C comes later in text)
        a3       x  x   x  x   x  x   .  .    .
        M4       x  x   x  x   x  x   x  .    .
        M5       x  x   x  x   x  x   x  x    .
        pad      .  .   .  .   .  .   .  .    x
    """
    return within_sample(segment_ids, causal)


def refusion_spec(segment_ids: torch.Tensor) -> AttentionSpec:
    """The training batch's mask spec; deliberately not ``causal_document`` (see the module doc)."""
    return AttentionSpec(refusion_mask, {"segment_ids": segment_ids}, causal_document=False)


def refusion_decode_mask(groups: torch.Tensor) -> MaskMod:
    """One decoding forward over ``[KV cache | step inputs]``; ``groups``: ``[b, kv]`` per entry.

    ``allowed(q, kv) = kv <= q and (group(kv) == SHARED or group(q) == SHARED or group(kv) == group(q))``

    Parallel completion of two slots X (group 0) and Y (group 1) after a cached context ``c0 c1``
    (``SHARED``); the round feeds ``x1 y1`` while ``x0 y0`` were cached by the previous round::

        q\\kv    c0 c1  x0 y0  x1 y1
        x1       x  x   x  .   x  .
        y1       x  x   .  x   .  x

    The next plan forward feeds the slots' last tokens (still in their groups) and then the
    remaining masks ``M`` (``SHARED``), which see everything before them::

        q\\kv    c0 c1  x0 y0 x1 y1  x2 y2  M  M
        x2       x  x   x  .  x  .   x  .   .  .
        y2       x  x   .  x  .  x   .  x   .  .
        M        x  x   x  x  x  x   x  x   x  .
        M        x  x   x  x  x  x   x  x   x  x

    Each completed slot's K/V thus see the context before its step plus the slot itself (the
    paper's parallel approximation); with every group ``SHARED`` this is plain causal attention.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        g_q, g_kv = groups[b, q_idx], groups[b, kv_idx]
        visible = (g_kv == SHARED) | (g_q == SHARED) | (g_kv == g_q)
        return (kv_idx <= q_idx) & visible

    return mask_mod
