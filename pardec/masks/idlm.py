"""I-DLM training mask over packed ``[x_t | x_0]`` samples (docs/methods/idlm.md#mask; the official
code's ``use_regular_causal=True``).

Every token carries four ``[b, s]`` metadata tensors (built by ``pardec.data_pipelines.idlm_batch``):

* ``segment_ids``: packed sample id inside the row, ``-1`` for padding;
* ``stream``: ``0`` for the noisy copy x_t, ``1`` for the clean copy x_0 (see ``XT`` / ``X0``);
* ``block_ids``: ``position // block_size``, blocks counted from position 0 of the sample (the
  prompt start), identical for the x_t and x_0 copies of a position;
* ``position_ids``: the token's position inside its sample (the x_t and x_0 copies share it), the
  very tensor passed to the model as ``position_ids``.

Comparisons use positions, never buffer indices, so the predicate does not depend on where a
sample or a stream sits in the packed row.
"""

from __future__ import annotations

import torch

from pardec.masks.core import MaskMod, within_sample

XT = 0
X0 = 1


def idlm_mask(
    segment_ids: torch.Tensor,
    stream: torch.Tensor,
    block_ids: torch.Tensor,
    position_ids: torch.Tensor,
) -> MaskMod:
    """I-DLM attention (strict causal everywhere; q = query, kv = key, p = position, B = block).

    Inside one sample (same ``segment_ids >= 0``):

    * x_t -> x_t: ``B(kv) == B(q)`` and ``p(kv) <= p(q)`` (causal inside the block);
    * x_t -> x_0: ``B(kv) < B(q)`` (the clean prefix before the query's block);
    * x_0 -> x_0: ``p(kv) <= p(q)`` (exactly the AR mask);
    * x_0 -> x_t: never.

    Nothing crosses samples; padding (segment ``-1``) sees only itself. One sample, L = 6,
    block size 2, blocks ``B0 = {0, 1}``, ``B1 = {2, 3}``, ``B2 = {4, 5}``::

                   x_t (noisy)            x_0 (clean)
        q\\kv    t0 t1 t2 t3 t4 t5    c0 c1 c2 c3 c4 c5
        t0       x  .  .  .  .  .     .  .  .  .  .  .
        t1       x  x  .  .  .  .     .  .  .  .  .  .
        t2       .  .  x  .  .  .     x  x  .  .  .  .
        t3       .  .  x  x  .  .     x  x  .  .  .  .
        t4       .  .  .  .  x  .     x  x  x  x  .  .
        t5       .  .  .  .  x  x     x  x  x  x  .  .
        c0       .  .  .  .  .  .     x  .  .  .  .  .
        c1       .  .  .  .  .  .     x  x  .  .  .  .
        c2       .  .  .  .  .  .     x  x  x  .  .  .
        c3       .  .  .  .  .  .     x  x  x  x  .  .
        c4       .  .  .  .  .  .     x  x  x  x  x  .
        c5       .  .  .  .  .  .     x  x  x  x  x  x

    A query at x_t position i thus sees the clean tokens before its block plus its own block's
    x_t tokens up to i: exactly what ISD feeds the model (clean prefix in the KV cache, then a
    causal run of MASKs), and x_0 never sees a MASK, so the clean stream equals a plain AR forward.
    """

    def inside_sample(b, h, q_idx, kv_idx):
        q_xt = stream[b, q_idx] == XT
        kv_xt = stream[b, kv_idx] == XT
        block_q = block_ids[b, q_idx]
        block_kv = block_ids[b, kv_idx]
        causal = position_ids[b, kv_idx] <= position_ids[b, q_idx]
        noisy_self = q_xt & kv_xt & (block_kv == block_q) & causal
        noisy_to_clean = q_xt & ~kv_xt & (block_kv < block_q)
        clean_self = ~q_xt & ~kv_xt & causal
        return noisy_self | noisy_to_clean | clean_self

    return within_sample(segment_ids, inside_sample)
