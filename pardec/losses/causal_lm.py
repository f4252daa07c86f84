"""Next-token labels over packed samples (the AR loss is
``pardec.losses.cross_entropy.token_mean_cross_entropy`` on them)."""

from __future__ import annotations

import torch

from pardec.common.constants import IGNORE_INDEX


def shifted_labels(input_ids: torch.Tensor, segment_ids: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Labels for logit shift: position i predicts token i+1 when both belong to the same packed
    sample (segment >= 0) and token i+1 is a target (``target_mask``). Others get -100.

    ``input_ids``, ``segment_ids``, ``target_mask``: ``[b, s]`` -> labels ``[b, s]``.
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    same_sample = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] >= 0)  # [b, s-1]
    keep = same_sample & target_mask[:, 1:]  # [b, s-1]
    labels[:, :-1] = torch.where(keep, input_ids[:, 1:], labels[:, :-1])
    return labels
