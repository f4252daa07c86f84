"""Packed I-DLM training batches: ``[x_t | x_0]`` per sample, greedy packing, shifted labels
(docs/methods/idlm.md#training-input).

Per sample of length L (prompt + answer + eos) with ``prompt_len`` = P prompt tokens:

* x_0 = the clean tokens; x_t = x_0 with every answer token (position >= P) replaced by
  ``<|mask|>``; prompt tokens stay clean in x_t (all-masked regime: no ratio, no 1/t weight);
* the sample occupies 2L consecutive slots ``[x_t | x_0]``; both copies take positions 0..L-1;
* blocks of ``block_size`` b are counted from position 0: ``block = position // b``
  (b trains ISD stride N = b + 1).

Labels, logit shift in both streams: the query at position i predicts x_0[i + 1] of the same
sample. A target counts only if it is an answer token (i + 1 >= P); the last position of a sample
predicts nothing, so no target ever crosses a sample boundary. The x_0 stream supervises positions
i = max(P, 1) - 1 .. L - 2, one target per answer token that has a predecessor (every answer token
when P >= 1; with P = 0, plain text, the first token cannot be predicted). Their number is
``n_answer_tokens``, the denominator of both L_mask and L_clean (:mod:`pardec.losses.idlm`)::

    position        0    1    2    3    4        (P = 2, L = 5; answer = a2 a3 eos)
    x_0 input       p0   p1   a2   a3   eos
    x_t input       p0   p1   M    M    M
    x_0 target      -    a2   a3   eos  -
    x_t target      -    -    a3   eos  -        (default)
    x_t target      -    a2   a3   eos  -        (supervise_last_prompt_slot=True)

Decision on the x_t stream (``supervise_last_prompt_slot``, recipe key
``recipe.supervise_last_prompt_slot``):

* ``False`` (default, docs/methods/idlm.md#loss, as in the official code): L_mask's targets are the
  ``<|mask|>`` x_t slots only, i = P .. L - 2 when P >= 1. The x_t slot at P - 1 (the last prompt token) is a clean
  input, and its x_t query sees exactly the clean prompt (the x_0 blocks before its block plus the
  clean x_t prompt tokens of its own block), so its logits equal the causal ones of x_0 at P - 1:
  supervising it would only repeat, inside L_mask, the L_clean term of the first answer token. The
  x_t stream then has one target fewer than the x_0 stream per sample with 1 <= P < L (none fewer
  for plain text, P = 0, or a prompt-only sample, P = L).
* ``True`` (the behaviour this builder had before the option, kept because the committed
  embedded-default benchmark was trained with it): the x_t query at P - 1 is an L_mask target too,
  so every answer token is an L_mask target exactly once and the two streams supervise the same
  positions. That query is ISD's bootstrap anchor (the last clean position, which yields the next
  token exactly, before the MASKs that yield the drafts); under gated LoRA (gate 0 on clean inputs) its term
  carries no LoRA gradient.

Either way the ``<|mask|>`` slots are supervised identically and L_mask is divided by
``n_answer_tokens`` (docs/methods/idlm.md#loss), so the option only adds or removes the anchor terms
from L_mask's sum.

Rows are packed greedily in input order up to ``pack_length`` slots and padded to exactly
``pack_length`` (static shapes), or with ``pad_to=longest`` to the longest row; padding has segment
``-1``, position 0, ``pad_token_id`` and no labels, and attends only to itself.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from pardec.common.constants import IGNORE_INDEX
from pardec.data_pipelines.packing import PAD_SEGMENT, checked_sample, greedy_pack, pad_rows, padded_length
from pardec.masks.core import AttentionSpec
from pardec.masks.idlm import X0, XT, idlm_mask


def build_idlm_batch(
    samples: Sequence[Mapping[str, Any]],
    *,
    mask_token_id: int,
    block_size: int,
    pack_length: int,
    pad_token_id: int = 0,
    supervise_last_prompt_slot: bool = False,
    pad_to: str = "pack_length",
) -> dict[str, Any]:
    """Pack tokenised samples into one I-DLM batch.

    ``samples``: each with ``input_ids`` (prompt + answer + eos; list or 1-D tensor) and
    ``prompt_len`` (int, 0 <= prompt_len <= len(input_ids)). ``supervise_last_prompt_slot``: also
    make the (clean) x_t slot of the last prompt token an L_mask target (module docstring; off by
    default, docs/methods/idlm.md#loss). ``pad_to``: ``pack_length`` or ``longest``
    (``pardec.data_pipelines.packing.PadTo``).

    Returns, with r rows and s = ``pack_length`` (``pad_to=longest``: the longest row's slots):

    * ``input_ids``, ``position_ids``: ``[r, s]`` long;
    * ``labels_clean_stream``: ``[r, s]``, the target token on x_0 slots whose target is an answer
      token, ``-100`` elsewhere; ``labels_mask_stream``: the same on the ``<|mask|>`` x_t slots
      (plus the x_t slot of the last prompt token when ``supervise_last_prompt_slot``);
    * ``attention``: ``AttentionSpec(idlm_mask, {segment_ids, stream, block_ids, position_ids})``;
    * ``n_answer_tokens``: 0-d long, the answer targets of the batch (the x_0 stream's supervised
      slots), the denominator of both losses whichever ``supervise_last_prompt_slot``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not samples:
        raise ValueError("build_idlm_batch got no samples")
    token_lists = [checked_sample(i, s, mask_token_id)[0] for i, s in enumerate(samples)]
    for i, ids in enumerate(token_lists):
        if 2 * len(ids) > pack_length:
            raise ValueError(
                f"sample {i}: length L={len(ids)} needs 2L={2 * len(ids)} slots as [x_t | x_0] "
                f"> pack_length={pack_length}; truncate upstream or raise pack_length"
            )
    lengths = [2 * len(ids) for ids in token_lists]
    rows = greedy_pack(lengths, pack_length)
    s = padded_length(rows, lengths, pack_length, pad_to)

    fields = ("input_ids", "position_ids", "labels_mask_stream", "labels_clean_stream", "segment_ids", "stream")
    filled = []
    for row in rows:
        parts = [_sample_slots(token_lists[i], int(samples[i]["prompt_len"]), seg, mask_token_id,
                               supervise_last_prompt_slot)
                 for seg, i in enumerate(row)]
        filled.append({k: torch.cat([p[k] for p in parts]) for k in fields})
    pad_values = {"input_ids": pad_token_id, "position_ids": 0, "labels_mask_stream": IGNORE_INDEX,
                  "labels_clean_stream": IGNORE_INDEX, "segment_ids": PAD_SEGMENT, "stream": X0}
    batch = pad_rows(filled, pad_values, s)  # each [r, s]

    metadata = {
        "segment_ids": batch.pop("segment_ids"),
        "stream": batch.pop("stream"),
        "block_ids": batch["position_ids"] // block_size,
        "position_ids": batch["position_ids"],
    }
    batch["attention"] = AttentionSpec(idlm_mask, metadata)
    batch["n_answer_tokens"] = (batch["labels_clean_stream"] != IGNORE_INDEX).sum()
    return batch


def _sample_slots(ids: torch.Tensor, prompt_len: int, segment: int, mask_token_id: int,
                  supervise_last_prompt_slot: bool) -> dict[str, torch.Tensor]:
    """The 2L slots ``[x_t | x_0]`` of one sample, every field ``[2L]``."""
    length = ids.numel()
    positions = torch.arange(length)  # [l]
    masked = positions >= prompt_len  # [l]
    noisy = torch.where(masked, torch.full_like(ids, mask_token_id), ids)  # [l]

    # Logit shift: position i predicts ids[i + 1]; keep answer targets only; the last position has none.
    targets = torch.full_like(ids, IGNORE_INDEX)  # [l]
    targets[:-1] = torch.where(positions[1:] >= prompt_len, ids[1:], IGNORE_INDEX)
    ignored = torch.full_like(ids, IGNORE_INDEX)
    # x_t: the <|mask|> slots, and optionally the clean slot of the last prompt token (P - 1).
    supervised_xt = masked | (positions == prompt_len - 1) if supervise_last_prompt_slot else masked  # [l]
    targets_xt = torch.where(supervised_xt, targets, IGNORE_INDEX)  # [l]

    return {
        "input_ids": torch.cat([noisy, ids]),
        "position_ids": torch.cat([positions, positions]),
        "labels_mask_stream": torch.cat([targets_xt, ignored]),
        "labels_clean_stream": torch.cat([ignored, targets]),
        "segment_ids": torch.full((2 * length,), segment, dtype=torch.long),
        "stream": torch.cat([torch.full((length,), XT), torch.full((length,), X0)]).long(),
    }
