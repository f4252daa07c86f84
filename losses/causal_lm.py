"""Next-token cross-entropy with packed samples (the AR loss, also the clean-stream loss of other recipes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.constants import IGNORE_INDEX


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


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Token-mean CE over positions with a label. ``logits`` ``[b, s, V]``, ``labels`` ``[b, s]``.

    With no target in the batch the loss is an exact zero that still depends on ``logits`` (so
    every rank runs the same backward), never NaN.
    """
    n_tokens = int((labels != IGNORE_INDEX).sum())
    if n_tokens == 0:
        return logits.sum() * 0.0, 0
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / n_tokens, n_tokens
