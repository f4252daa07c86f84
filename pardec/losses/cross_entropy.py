"""Token-mean cross-entropy, the one CE every loss of pardec uses (AR, I-DLM's two streams,
Jacobi Forcing's AR term, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pardec.common.constants import IGNORE_INDEX


def token_mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean CE over the slots with ``labels != IGNORE_INDEX``, and their count.

    ``logits``: ``[..., V]``; ``labels``: ``logits.shape[:-1]``.

    1. Keep the labelled slots; only those rows of the logits are gathered and upcast to float32
       (the value of ``ignore_index`` CE on the whole tensor, at a fraction of the memory).
    2. Sum their CE and divide by their number.
    3. No labelled slot: an exact zero that stays in the autograd graph (zero gradients, so every
       rank still runs the same backward), never NaN, even where the logits hold ``inf``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    keep = labels != IGNORE_INDEX  # [...]
    count = int(keep.sum())
    if count == 0:
        return logits.flatten()[:0].sum().float(), 0  # []
    picked = logits[keep].float()  # [n, V]
    return F.cross_entropy(picked, labels[keep], reduction="sum") / count, count
