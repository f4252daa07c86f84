"""Packed ReFusion training buffers: slot masking, clean-slot permutation, original positions
(docs/methods/refusion.md#slot-masking, docs/methods/refusion.md#clean-slot-permutation).

Per sample (``input_ids`` = prompt + response + EOS, ``prompt_len`` = P; the *answer* is
``input_ids[P:]``, the response plus EOS, A tokens):

1. slot size k drawn uniformly from ``slot_sizes`` (a one-element set fixes it); the answer is cut
   into K = ceil(A / k) slots, the last one possibly short (A = 0: no slot, the prompt only);
2. t ~ U(0, 1); ``masking="count"`` (the paper, default) masks exactly max(1, floor(t K))
   slots chosen uniformly; ``masking="bernoulli"`` (the official code) masks each slot
   independently with p = (1 - 1e-3) t + 1e-3, so it may mask none or all of them; with
   probability ``suffix_mask_prob`` (an option beyond the paper, 0 by default) the same number of
   slots is masked at the *end* of the answer instead, the state a semi-AR decoder plans from;
3. the clean slots are randomly permuted (with probability ``in_order_prob`` a sample keeps them in
   position order instead: an option beyond the paper, 0 by default); the buffer is ``[prompt |
   clean slots in that order | masked slots in position order]``, each masked token replaced by
   ``<|mask|>``; every token keeps its original position id (prompt 0..P-1, answer token a at P + a).

Labels (``-100`` = ignored; by default nothing crosses a slot, and never a sample)::

    answer a0..a5 (P = 2), k = 2: slots S0 = a0 a1, S1 = a2 a3, S2 = a4 a5; S1 masked; order S2, S0
    buffer        p0   p1   a4   a5   a0   a1   M    M
    position      0    1    6    7    2    3    4    5
    labels_arm    -    -    a5   -    a1   -    -    -      (next token inside the clean slot)
    labels_mdm    -    -    -    -    -    -    a2   a3     (each mask predicts its own token)

``labels_arm`` are the paper's targets j = 2..k of every clean slot (Eq. 1), ``labels_mdm`` every
masked token (Eq. 2, no logit shift). With ``ar_across_slots`` (beyond the paper, off by default) a
token whose buffer successor is also its position successor (the prompt's last token before slot
0, a clean slot's last token before the next slot kept in order) also predicts that successor: the
plain next-token target, so slot starts keep an AR signal (above nothing changes; with the clean
order S0, S2 instead, p1 would also predict a0, and a1 still nothing since S1 is masked).

For ``mdm_norm=llada`` each sample also gets the weight ``1 / (p_mask * A)`` of its masked tokens
(LLaDA: sum CE / p_mask / answer_len / B), with p_mask the Bernoulli probability, or for count
masking the masked fraction of slots.

Randomness: each sample draws from its own ``random.Random(seed)``; the method derives the seed
from (recipe seed, optimiser step, micro-batch, dataset index) (:func:`layout_seed`), so a resumed
run rebuilds exactly the same buffers. Rows are packed greedily (``greedy_pack``) up to
``pack_length`` tokens and padded to it (``pad_rows``; with ``pad_to=longest``, to the longest row):
padding has segment ``-1``, position 0, ``pad_token_id`` and no label. The attention is
:func:`pardec.masks.refusion.refusion_mask`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pardec.common.config_fields import Choice
from pardec.common.constants import IGNORE_INDEX
from pardec.data_pipelines.packing import PAD_SEGMENT, checked_sample, greedy_pack, pad_rows, padded_length
from pardec.masks.refusion import refusion_spec


class Masking(Choice):
    """count (exactly max(1, floor(t K)) slots, the paper) | bernoulli (per slot with p = t, the official code)."""

    count = "count"
    bernoulli = "bernoulli"


BERNOULLI_EPS = 1e-3


@dataclass(frozen=True)
class SlotLayout:
    """The random choices for one sample: what the buffer builder consumes."""

    slot_size: int  # k
    n_slots: int  # K = ceil(A / k)
    masked: tuple[int, ...]  # masked slot indices, ascending
    clean_order: tuple[int, ...]  # clean slot indices in buffer order (a permutation)
    p_mask: float  # Bernoulli p, or the masked fraction of slots (count); 0 when K = 0


def layout_seed(seed: int, step: int, micro: int, index: int) -> int:
    """A 63-bit seed for one sample's layout from (seed, step, micro-batch, dataset index)."""
    state = np.random.SeedSequence([seed, step, micro, index]).generate_state(2, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def draw_layout(answer_len: int, rng: random.Random, slot_sizes: Sequence[int], masking: str,
                in_order_prob: float = 0.0, suffix_mask_prob: float = 0.0) -> SlotLayout:
    """Slot size, masked slots and the clean-slot permutation of one sample (steps 1-3 above).
    With ``in_order_prob`` = ``suffix_mask_prob`` = 0 no extra number is drawn (the layouts are
    those of the paper's rule)."""
    masking = Masking(masking)  # ValueError naming the choices
    for name, prob in (("in_order_prob", in_order_prob), ("suffix_mask_prob", suffix_mask_prob)):
        if not 0 <= prob <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {prob}")
    k = rng.choice(list(slot_sizes))
    n_slots = math.ceil(answer_len / k)
    t = rng.random()
    if n_slots == 0:
        return SlotLayout(k, 0, (), (), 0.0)
    if masking == "count":
        n_masked = max(1, math.floor(t * n_slots))
        masked = tuple(sorted(rng.sample(range(n_slots), n_masked)))
        p_mask = n_masked / n_slots
    else:
        p_mask = (1 - BERNOULLI_EPS) * t + BERNOULLI_EPS
        masked = tuple(i for i in range(n_slots) if rng.random() < p_mask)
    if suffix_mask_prob > 0 and rng.random() < suffix_mask_prob:
        masked = tuple(range(n_slots - len(masked), n_slots))
    clean = [i for i in range(n_slots) if i not in set(masked)]
    if not (in_order_prob > 0 and rng.random() < in_order_prob):
        rng.shuffle(clean)
    return SlotLayout(k, n_slots, masked, tuple(clean), p_mask)


def build_refusion_batch(
    samples: Sequence[Mapping[str, Any]],
    *,
    mask_token_id: int,
    pack_length: int,
    seeds: Sequence[int],
    slot_sizes: Sequence[int] = (4, 8, 16, 32),
    masking: str = "count",
    in_order_prob: float = 0.0,
    suffix_mask_prob: float = 0.0,
    ar_across_slots: bool = False,
    pad_token_id: int = 0,
    pad_to: str = "pack_length",
) -> dict[str, Any]:
    """Pack tokenised samples into one ReFusion batch.

    ``samples``: each with ``input_ids`` (prompt + answer; list or 1-D tensor) and ``prompt_len``;
    ``seeds[i]`` seeds sample i's layout. ``pad_to``: ``pack_length`` or ``longest``
    (``pardec.data_pipelines.packing.PadTo``).

    Returns, with r rows and s = ``pack_length`` (``pad_to=longest``: the longest row's slots):

    * ``input_ids``, ``position_ids``, ``labels_arm``, ``labels_mdm``: ``[r, s]`` long;
    * ``mdm_sample``: ``[r, s]`` long, the sample index (0..n-1 over the batch) of each masked
      token, ``-1`` elsewhere; ``mdm_weight``: ``[n]`` float, ``1 / (p_mask * A)`` per sample (0
      without a masked token), for ``mdm_norm=llada``;
    * ``attention``: ``refusion_spec(segment_ids)``;
    * ``n_samples``: n; ``slot_sizes``: ``[n]`` long, the k drawn per sample.
    """
    if not samples:
        raise ValueError("build_refusion_batch got no samples")
    if len(seeds) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(seeds)} seeds")
    if not slot_sizes or any(int(k) < 1 for k in slot_sizes):
        raise ValueError(f"slot sizes must be a non-empty set of integers >= 1, got {list(slot_sizes)}")
    token_lists = [checked_sample(i, s, mask_token_id)[0] for i, s in enumerate(samples)]
    lengths = [len(ids) for ids in token_lists]
    rows = greedy_pack(lengths, pack_length)
    s = padded_length(rows, lengths, pack_length, pad_to)

    layouts, weights = [], []
    for ids, sample, seed in zip(token_lists, samples, seeds, strict=True):
        answer_len = ids.numel() - int(sample["prompt_len"])
        layout = draw_layout(answer_len, random.Random(seed), slot_sizes, masking, in_order_prob,
                             suffix_mask_prob)
        layouts.append(layout)
        weights.append(1.0 / (layout.p_mask * answer_len) if layout.masked else 0.0)

    fields = ("input_ids", "position_ids", "labels_arm", "labels_mdm", "mdm_sample", "segment_ids")
    filled = []
    for row in rows:
        parts = [_sample_buffer(token_lists[i], int(samples[i]["prompt_len"]), layouts[i], seg, i, mask_token_id,
                                ar_across_slots) for seg, i in enumerate(row)]
        filled.append({k: torch.cat([p[k] for p in parts]) for k in fields})
    pad_values = {"input_ids": pad_token_id, "position_ids": 0, "labels_arm": IGNORE_INDEX,
                  "labels_mdm": IGNORE_INDEX, "mdm_sample": -1, "segment_ids": PAD_SEGMENT}
    batch = pad_rows(filled, pad_values, s)  # each [r, s]

    batch["attention"] = refusion_spec(batch.pop("segment_ids"))
    batch["mdm_weight"] = torch.tensor(weights, dtype=torch.float32)  # [n]
    batch["n_samples"] = len(samples)
    batch["slot_sizes"] = torch.tensor([layout.slot_size for layout in layouts], dtype=torch.long)  # [n]
    return batch


def _sample_buffer(
    ids: torch.Tensor, prompt_len: int, layout: SlotLayout, segment: int, sample: int, mask_token_id: int,
    ar_across_slots: bool = False,
) -> dict[str, torch.Tensor]:
    """The reordered buffer of one sample, every field ``[L]`` (L = len(ids))."""
    k = layout.slot_size
    answer_len = ids.numel() - prompt_len

    # 1. Buffer order of answer indices: clean slots in permuted order, then masked slots in order.
    def slot(i: int) -> torch.Tensor:
        return torch.arange(i * k, min((i + 1) * k, answer_len))  # answer indices of slot i

    empty = torch.zeros(0, dtype=torch.long)
    clean = [slot(i) for i in layout.clean_order]
    masked = torch.cat([slot(i) for i in layout.masked]) if layout.masked else empty  # [m]
    clean_idx = torch.cat(clean) if clean else empty  # [c]

    # 2. ARM targets: the next token inside the same clean slot. A slot's last token has none, or with
    #    ar_across_slots the next slot's first token when that slot comes next in the buffer.
    order = layout.clean_order
    def last_target(j: int) -> int:  # of the j-th clean slot in buffer order
        follows = j + 1 < len(order) and order[j + 1] == order[j] + 1
        return int(ids[prompt_len + order[j + 1] * k]) if ar_across_slots and follows else IGNORE_INDEX

    arm = [torch.cat([ids[prompt_len + s[1:]], torch.tensor([last_target(j)])]) for j, s in enumerate(clean)]
    arm_labels = torch.cat(arm) if arm else empty  # [c]

    # 3. Assemble [prompt | clean | masked]; positions are the original ones.
    prompt_ignore = torch.full((prompt_len,), IGNORE_INDEX, dtype=torch.long)
    prompt_arm = prompt_ignore.clone()
    if ar_across_slots and prompt_len and order[:1] == (0,):
        prompt_arm[-1] = ids[prompt_len]  # the prompt's last token predicts answer token 0
    answer_order = torch.cat([clean_idx, masked])  # [A]
    length = ids.numel()
    return {
        "input_ids": torch.cat([ids[:prompt_len], ids[prompt_len + clean_idx],
                                torch.full_like(masked, mask_token_id)]),
        "position_ids": torch.cat([torch.arange(prompt_len), prompt_len + answer_order]),
        "labels_arm": torch.cat([prompt_arm, arm_labels, torch.full_like(masked, IGNORE_INDEX)]),
        "labels_mdm": torch.cat([prompt_ignore, torch.full_like(clean_idx, IGNORE_INDEX), ids[prompt_len + masked]]),
        "mdm_sample": torch.cat([torch.full((prompt_len + clean_idx.numel(),), -1), torch.full_like(masked, sample)]),
        "segment_ids": torch.full((length,), segment, dtype=torch.long),
    }
