"""Block-diffusion (SDAR-style) mask over packed ``[x_t | x_0]`` samples: the I-DLM training ablation.

The I-DLM paper (§4.3, Fig. 6a; App. E, Fig. 8b) compares its causal mask with "standard block
diffusion training (block-causal attention, no logit shift)"; this is the official code's
``use_regular_causal=False`` branch. Metadata is the I-DLM one (``pardec.masks.idlm``) minus positions:
``segment_ids`` (sample id, ``-1`` = pad), ``stream`` (0 = x_t, 1 = x_0) and ``block_ids``
(``position // block_size`` from the sample start).

Pair it with *unshifted* labels (each MASK predicts its own token): an x_0 query sees the clean
tokens after it inside its own block, so a next-token target on x_0 would be visible to it.

The MDM recipe's clean-context training (``pardec.data_pipelines.mdm_batch``, ``recipe.clean_context``)
uses the same predicate with answer-based block ids (``pardec.masks.mdm.answer_block_ids``: prompt = block
0) and a logit shift; there an x_0 query carries a next-token target only at the last position of
a block, where the target opens the next block and so is not visible to it.
"""

from __future__ import annotations

import torch

from pardec.masks.core import MaskMod, within_sample
from pardec.masks.idlm import XT


def block_diffusion_mask(segment_ids: torch.Tensor, stream: torch.Tensor, block_ids: torch.Tensor) -> MaskMod:
    """SDAR block diffusion (q = query, kv = key, B = block index).

    Inside one sample (same ``segment_ids >= 0``):

    * x_t -> x_t: ``B(kv) == B(q)`` (bidirectional inside the block);
    * x_t -> x_0: ``B(kv) < B(q)`` (the clean blocks before the query's block);
    * x_0 -> x_0: ``B(kv) <= B(q)`` (block-causal: bidirectional inside the block);
    * x_0 -> x_t: never.

    Nothing crosses samples; padding (segment ``-1``) sees only itself. One sample, L = 6,
    block size 2::

                   x_t (noisy)            x_0 (clean)
        q\\kv    t0 t1 t2 t3 t4 t5    c0 c1 c2 c3 c4 c5
        t0       x  x  .  .  .  .     .  .  .  .  .  .
        t1       x  x  .  .  .  .     .  .  .  .  .  .
        t2       .  .  x  x  .  .     x  x  .  .  .  .
        t3       .  .  x  x  .  .     x  x  .  .  .  .
        t4       .  .  .  .  x  x     x  x  x  x  .  .
        t5       .  .  .  .  x  x     x  x  x  x  .  .
        c0       .  .  .  .  .  .     x  x  .  .  .  .
        c1       .  .  .  .  .  .     x  x  .  .  .  .
        c2       .  .  .  .  .  .     x  x  x  x  .  .
        c3       .  .  .  .  .  .     x  x  x  x  .  .
        c4       .  .  .  .  .  .     x  x  x  x  x  x
        c5       .  .  .  .  .  .     x  x  x  x  x  x
    """

    def inside_sample(b, h, q_idx, kv_idx):
        q_xt = stream[b, q_idx] == XT
        kv_xt = stream[b, kv_idx] == XT
        block_q = block_ids[b, q_idx]
        block_kv = block_ids[b, kv_idx]
        noisy_self = q_xt & kv_xt & (block_kv == block_q)
        noisy_to_clean = q_xt & ~kv_xt & (block_kv < block_q)
        clean_self = ~q_xt & ~kv_xt & (block_kv <= block_q)
        return noisy_self | noisy_to_clean | clean_self

    return within_sample(segment_ids, inside_sample)
