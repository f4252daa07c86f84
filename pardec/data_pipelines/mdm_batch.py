"""Packed masked-diffusion (MDM) training batches: random answer masking, logit shift, weights
(docs/methods/mdm.md#training).

Per sample of length L (prompt + answer + eos) with ``prompt_len`` = P:

1. optional EOS padding: with ``pad_answer_to = A`` the answer (positions >= P, its EOS included)
   is padded with EOS to exactly A tokens (LLaDA / Dream SFT; fixed-length decoders rely on the
   model predicting EOS after the end), and an answer longer than A is an error;
2. t ~ U(eps, 1), one per sample; each *maskable* answer token (position >= max(P, 1): the first
   token of a text without prompt has no predecessor to predict it) is replaced by ``<|mask|>``
   independently with probability t; prompt tokens always stay clean. With ``suffix_mask_prob = q``
   (default 0: off), a sample is in addition, with probability q, masked from a cut c drawn
   uniformly over its maskable positions to its end: the state of semi-AR / left-to-right decoding
   (a clean prefix, an all-masked future). Under uniform masking a result that the answer repeats
   later (``= 93 dollars. Then Ben has 93 + ...``) is mostly visible elsewhere and can be copied
   instead of computed, which decoding never allows;
3. logit shift (Dream): the query at position i predicts the token at i + 1. A target exists only
   where token i + 1 is masked; the last position predicts nothing, so nothing crosses samples::

       position      0    1    2    3    4       (P = 2; answer a2 a3 eos; a3 and eos masked)
       input         p0   p1   a2   M    M
       target        -    -    -    a3   eos     (at the query before each masked token)

4. the weight of each target: ``1/t`` (linear schedule, LLaDA / dllm; for a suffix-masked sample
   ``1/t_eff`` with t_eff its masked fraction of the maskable tokens, so that, as in expectation
   under uniform masking, its weights sum to its maskable-token count) or Dream's CART weight
   (``cart``): ``w_i = sum_j 0.5 p (1-p)^(|i-j|-1)`` over the clean tokens j != i of the same sample
   (a symmetric geometric kernel of the distance from the masked token i to the visible context;
   p = ``cart_p``, 0.3 by default). The weight sits on the query slot of its target.

**Clean context** (``clean_context=True``, block-causal attention only; SDAR / BD3-LM style). With
one noisy stream the answer blocks left of a block are noised too, while semi-AR decoding always
sees them clean. With this option each sample is laid out as ``[x_0 | x_t]``: the clean sample
(positions 0 .. L-1) followed by its noisy answer (positions P .. L-1, the same position ids), under
``pardec.masks.block_diffusion.block_diffusion_mask`` with the answer-based block ids of ``pardec.masks.mdm``
(prompt = block 0). An x_t token sees its own noisy block and the clean blocks before it, which is
exactly a decoding step's view; x_0 is block-causal, as the decoders' committed prefix. The masking
draw and the weights are those of steps 2 and 4; only the slot carrying each target moves:

* a masked token whose predecessor is in the *same* block is predicted by the predecessor's x_t slot;
* a masked token that *opens* a block (predecessor in the block before; the first answer token
  after the prompt too) is predicted by the predecessor's x_0 slot: in decoding that prediction
  comes from the last committed token, whose row sees only the clean blocks before::

      P = 1, answer a1 .. a4 + eos, block size 2 (blocks: p0 | a1 a2 | a3 a4 | eos); a2, a3 masked
      stream      x_0 ......................   x_t ..................
      input       p0  a1  a2  a3  a4  eos      a1  M   M   a4  eos
      target      -   -   a3  -   -   -        a2  -   -   -   -
                          (a3 opens block 2)   (a2: same block as a1)

For CART the context of a target is what its query sees: the clean blocks before its block, plus
the clean tokens of its own block when an x_t slot predicts it.

Rows are packed greedily in input order (``greedy_pack``) and right-padded to ``pack_length``
(``pad_rows``; with ``pad_to=longest``, to the longest row); padding has segment ``-1``, position 0,
no target, weight 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pardec.common.config_fields import Choice
from pardec.common.constants import IGNORE_INDEX
from pardec.data_pipelines.packing import PAD_SEGMENT, checked_sample, greedy_pack, pad_rows, padded_length
from pardec.masks.block_diffusion import block_diffusion_mask
from pardec.masks.core import AttentionSpec
from pardec.masks.idlm import X0, XT
from pardec.masks.mdm import BIDIRECTIONAL, BLOCK, answer_block_ids, bidirectional_mask, block_causal_mask


class Weighting(Choice):
    """linear (weight 1/t) | cart (Dream's context-adaptive weight)."""

    linear = "linear"
    cart = "cart"



def build_mdm_batch(
    samples: Sequence[Mapping[str, Any]],
    *,
    mask_token_id: int,
    pack_length: int,
    pad_token_id: int,
    eos_token_id: int,
    attention: str = BIDIRECTIONAL,
    block_size: int | None = None,
    eps: float = 1e-3,
    weighting: str = "linear",
    cart_p: float = 0.3,
    pad_answer_to: int | None = None,
    suffix_mask_prob: float = 0.0,
    clean_context: bool = False,
    generator: torch.Generator | None = None,
    pad_to: str = "pack_length",
) -> dict[str, Any]:
    """Pack tokenised samples (``input_ids``, ``prompt_len``) into one MDM batch.

    Returns, with n samples, r rows and s = ``pack_length`` (``pad_to=longest``: the longest row's slots,
    ``pardec.data_pipelines.packing.PadTo``):

    * ``input_ids``, ``position_ids``: ``[r, s]`` long (masked inputs; positions restart per sample);
    * ``labels``: ``[r, s]``, the target at the query before each masked token, ``-100`` elsewhere;
    * ``weights``: ``[r, s]`` float, the target's weight (1/t or CART), 0 where there is no target;
    * ``sample_ids``: ``[r, s]`` long, the sample index (0..n-1) of each slot, ``-1`` for padding;
    * ``n_answer``: ``[n]`` long, maskable answer tokens per sample (the normaliser);
    * ``t``: ``[n]`` float, the masking ratio drawn for each sample;
    * ``attention``: bidirectional or block-causal ``AttentionSpec`` over ``segment_ids`` (+ ``block_ids``);
      with ``clean_context`` the ``[x_0 | x_t]`` block-diffusion spec (+ ``stream``, 1 = x_0, 0 = x_t).

    Randomness comes from ``generator`` (default: torch's global generator, which the trainer seeds
    and restores on resume).
    """
    if not samples:
        raise ValueError("build_mdm_batch got no samples")
    if attention not in (BIDIRECTIONAL, BLOCK):
        raise ValueError(f"attention must be {BIDIRECTIONAL!r} or {BLOCK!r}, got {attention!r}")
    if attention == BLOCK and (block_size is None or block_size < 1):
        raise ValueError(f"block-causal attention needs block_size >= 1, got {block_size}")
    if clean_context and attention != BLOCK:
        raise ValueError(f"clean_context needs block-causal attention ({BLOCK!r}), got {attention!r}")
    weighting = Weighting(weighting)  # ValueError naming the choices
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    if not 0 < cart_p <= 1:
        raise ValueError(f"cart_p must be in (0, 1], got {cart_p}")
    if not 0 <= suffix_mask_prob <= 1:
        raise ValueError(f"suffix_mask_prob must be in [0, 1], got {suffix_mask_prob}")

    token_lists, prompt_lens = [], []
    for i, sample in enumerate(samples):
        ids, p_len = checked_sample(i, sample, mask_token_id)
        if pad_answer_to is not None:
            ids = _pad_answer(i, ids, p_len, pad_answer_to, eos_token_id)
        token_lists.append(ids)
        prompt_lens.append(p_len)
    # A clean-context sample is its L clean tokens plus its L - P noisy answer tokens.
    lengths = [ids.numel() + (ids.numel() - p_len if clean_context else 0)
               for ids, p_len in zip(token_lists, prompt_lens)]
    rows = greedy_pack(lengths, pack_length)
    s = padded_length(rows, lengths, pack_length, pad_to)

    t = eps + (1 - eps) * torch.rand(len(samples), generator=generator)  # [n]
    # Drawn only when the option is on, so the default keeps the random stream of uniform masking.
    suffix = torch.rand(len(samples), generator=generator) < suffix_mask_prob if suffix_mask_prob else None  # [n]
    parts_by_sample, n_answer = {}, []
    for i, (ids, p_len) in enumerate(zip(token_lists, prompt_lens)):
        with_suffix = suffix is not None and bool(suffix[i])
        blocks = answer_block_ids(torch.arange(ids.numel()), p_len, block_size or 1)  # [l]
        parts_by_sample[i] = _sample_slots(ids, p_len, float(t[i]), i, mask_token_id, weighting, cart_p, with_suffix,
                                           blocks if clean_context else None, generator)
        n_answer.append(int(parts_by_sample[i].pop("n_answer")))

    fields = ("input_ids", "position_ids", "labels", "weights", "sample_ids", "segment_ids", "block_ids")
    fields += ("stream",) if clean_context else ()
    filled = []
    for row in rows:
        parts = [parts_by_sample[i] for i in row]
        for seg, part in enumerate(parts):
            part["segment_ids"] = torch.full_like(part["input_ids"], seg)
            part["block_ids"] = answer_block_ids(part["position_ids"], prompt_lens[row[seg]], block_size or 1)
        filled.append({k: torch.cat([p[k] for p in parts]) for k in fields})
    long_pads = {"input_ids": pad_token_id, "position_ids": 0, "labels": IGNORE_INDEX, "sample_ids": PAD_SEGMENT,
                 "segment_ids": PAD_SEGMENT, "block_ids": 0}
    if clean_context:
        long_pads["stream"] = X0
    batch = pad_rows(filled, long_pads, s)  # each [r, s] long
    weights = torch.zeros(len(rows), s)  # [r, s]
    for r, row in enumerate(filled):
        weights[r, : row["weights"].numel()] = row["weights"]
    batch["weights"] = weights

    segment_ids, block_ids = batch.pop("segment_ids"), batch.pop("block_ids")
    if attention == BIDIRECTIONAL:
        batch["attention"] = AttentionSpec(bidirectional_mask, {"segment_ids": segment_ids})
    elif clean_context:
        metadata = {"segment_ids": segment_ids, "stream": batch.pop("stream"), "block_ids": block_ids}
        batch["attention"] = AttentionSpec(block_diffusion_mask, metadata)
    else:
        batch["attention"] = AttentionSpec(block_causal_mask, {"segment_ids": segment_ids, "block_ids": block_ids})
    batch["n_answer"] = torch.tensor(n_answer, dtype=torch.long)  # [n]
    batch["t"] = t
    return batch


def cart_weights(visible: torch.Tensor, p: float) -> torch.Tensor:
    """Dream's context-adaptive (CART) weight of every position of one sample, ``[l]`` float.

    ``visible``: ``[l]`` bool, the tokens every position's context shows (the unmasked ones), or
    ``[l, l]`` bool, row i = what position i's context shows. ``w_i = sum_{j visible to i, j != i}
    0.5 p (1-p)^(|i-j|-1)``: a masked token next to much visible context is easy and gets a large
    weight; one far from any context gets a small one.
    """
    positions = torch.arange(visible.shape[-1])
    distance = (positions[:, None] - positions[None, :]).abs()  # [l, l]
    kernel = 0.5 * p * (1 - p) ** (distance - 1).clamp(min=0).double()  # [l, l]
    kernel = kernel.masked_fill(distance == 0, 0.0)
    return (kernel * visible.double()).sum(-1).float()  # [l]


def _pad_answer(index: int, ids: torch.Tensor, prompt_len: int, answer_len: int, eos_token_id: int) -> torch.Tensor:
    have = ids.numel() - prompt_len
    if have > answer_len:
        raise ValueError(
            f"sample {index}: answer of {have} tokens > recipe.pad_answer_to={answer_len}; "
            "raise it or truncate upstream"
        )
    return torch.cat([ids, torch.full((answer_len - have,), eos_token_id, dtype=torch.long)])


def _sample_slots(
    ids: torch.Tensor, prompt_len: int, t: float, index: int, mask_token_id: int, weighting: str, cart_p: float,
    with_suffix: bool, clean_blocks: torch.Tensor | None, generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """The slots of one sample, every field ``[l]`` (``[2l - P]`` with ``clean_blocks``, the sample's
    block ids: the clean-context layout), plus its maskable-answer count ``n_answer``."""
    length = ids.numel()
    positions = torch.arange(length)  # [l]
    first = max(prompt_len, 1)
    maskable = positions >= first  # [l]
    masked = maskable & (torch.rand(length, generator=generator) < t)  # [l]
    if with_suffix and length > first:
        cut = first + int(torch.randint(length - first, (1,), generator=generator))
        masked |= positions >= cut
        t = float(masked.sum()) / float(maskable.sum())  # t_eff: the 1/t weight below keeps sum(w) = n_answer
    noisy = torch.where(masked, torch.full_like(ids, mask_token_id), ids)  # [l]

    # Logit shift: the target of a masked position j sits on a query at j - 1.
    opens_block = torch.zeros(length, dtype=torch.bool)  # [l], j's predecessor is in the block before
    if clean_blocks is not None:
        opens_block[1:] = clean_blocks[1:] != clean_blocks[:-1]
    if weighting == "linear":
        target_weight = torch.full((length,), 1.0 / t)  # [l]
    elif clean_blocks is None:
        target_weight = cart_weights(~masked, cart_p)  # [l], weight of the target at each position
    else:
        earlier = clean_blocks[None, :] < clean_blocks[:, None]  # [l, l]
        own_block = (clean_blocks[None, :] == clean_blocks[:, None]) & ~masked[None, :] & ~opens_block[:, None]
        target_weight = cart_weights(earlier | own_block, cart_p)  # [l]

    def shifted(where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels and weights ``[l]`` of the queries before the masked positions in ``where``."""
        labels = torch.full_like(ids, IGNORE_INDEX)  # [l]
        weights = torch.zeros(length)  # [l]
        take = masked[1:] & where[1:]  # [l - 1]
        labels[:-1] = torch.where(take, ids[1:], IGNORE_INDEX)
        weights[:-1] = torch.where(take, target_weight[1:], 0.0)
        return labels, weights

    if clean_blocks is None:
        labels, weights = shifted(torch.ones(length, dtype=torch.bool))
        return {"input_ids": noisy, "position_ids": positions, "labels": labels, "weights": weights,
                "sample_ids": torch.full((length,), index, dtype=torch.long), "n_answer": maskable.sum()}

    clean_labels, clean_weights = shifted(opens_block)  # [l] each, x_0 queries
    noisy_labels, noisy_weights = shifted(~opens_block)  # [l] each, x_t queries (answer part kept)
    answer = positions >= prompt_len  # [l]
    n_noisy = int(answer.sum())
    return {
        "input_ids": torch.cat([ids, noisy[answer]]),
        "position_ids": torch.cat([positions, positions[answer]]),
        "labels": torch.cat([clean_labels, noisy_labels[answer]]),
        "weights": torch.cat([clean_weights, noisy_weights[answer]]),
        "sample_ids": torch.full((length + n_noisy,), index, dtype=torch.long),
        "stream": torch.cat([torch.full((length,), X0, dtype=torch.long),
                             torch.full((n_noisy,), XT, dtype=torch.long)]),
        "n_answer": maskable.sum(),
    }
