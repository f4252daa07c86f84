"""ReFusion hybrid loss: L = L_ARM + lambda * L_MDM (paper Eq. 1-3; docs/methods/refusion.md#loss).

References: ReFusion, arXiv:2512.13586, §4.3 Eq. (1)-(3).

Labels come from ``pardec.data_pipelines.refusion_batch`` (one forward over the reordered, packed rows):

* L_ARM: next-token CE inside each clean slot (targets j = 2..k of the slot, never across slots),
  token mean over all such targets of the micro-batch;
* L_MDM, ``mdm_norm="mean"`` (the paper, default): CE of every ``<|mask|>`` position predicting its own
  token, token mean over the masked tokens of the micro-batch (this mean already contains the 1/t
  weight of the MDM bound);
* L_MDM, ``mdm_norm="llada"`` (official code): sum_i CE_i / p_mask / answer_len / B, i.e. per
  sample the masked tokens' CE sum times ``mdm_weight = 1 / (p_mask * A)``, summed over samples
  and divided by the number of samples B (samples without a mask count in B).

An empty group (no clean slot anywhere: all masked; no mask; empty answers) contributes an exact
zero that stays in the autograd graph, never NaN. Both terms are logged.
"""

from __future__ import annotations

import torch

from pardec.common.config_fields import Choice
from pardec.common.constants import IGNORE_INDEX
from pardec.losses.cross_entropy import token_mean_cross_entropy


class MDMNorm(Choice):
    """mean (token mean over masked tokens) | llada (the official sum CE / p_mask / answer_len / B)."""

    mean = "mean"
    llada = "llada"


def refusion_loss(
    logits: torch.Tensor,
    labels_arm: torch.Tensor,
    labels_mdm: torch.Tensor,
    *,
    mdm_lambda: float = 1.0,
    mdm_norm: str = "mean",
    mdm_sample: torch.Tensor | None = None,
    mdm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss and floats to log (``l_arm``, ``l_mdm``, ``n_arm_tokens``, ``n_mdm_tokens``).

    ``logits``: ``[b, s, V]``; ``labels_*``: ``[b, s]``. ``llada`` also needs ``mdm_sample``
    (``[b, s]``, sample index of each masked token, -1 elsewhere) and ``mdm_weight`` (``[n]``).
    """
    if logits.shape[:2] != labels_arm.shape or logits.shape[:2] != labels_mdm.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match labels {tuple(labels_arm.shape)} / {tuple(labels_mdm.shape)}"
        )
    mdm_norm = MDMNorm(mdm_norm)  # ValueError naming the choices
    if not mdm_lambda >= 0:
        raise ValueError(f"the MDM weight lambda must be >= 0, got {mdm_lambda}")

    # 1. L_ARM: token-mean next-token CE inside the clean slots.
    l_arm, n_arm = token_mean_cross_entropy(logits, labels_arm)  # []

    # 2. L_MDM: each mask predicts its own token.
    if mdm_norm == "mean":
        l_mdm, n_mdm = token_mean_cross_entropy(logits, labels_mdm)  # []
    else:
        if mdm_sample is None or mdm_weight is None:
            raise ValueError("mdm_norm='llada' needs mdm_sample [b, s] and mdm_weight [n]")
        l_mdm, n_mdm = _llada_mdm(logits, labels_mdm, mdm_sample, mdm_weight)  # []

    # 3. Total.
    total = l_arm + mdm_lambda * l_mdm  # []
    logs = {"l_arm": float(l_arm.detach()), "l_mdm": float(l_mdm.detach()),
            "n_arm_tokens": float(n_arm), "n_mdm_tokens": float(n_mdm)}
    return total, logs


def _llada_mdm(
    logits: torch.Tensor, labels_mdm: torch.Tensor, mdm_sample: torch.Tensor, mdm_weight: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """sum over samples of ``weight_n * sum_{masked i of n} CE_i``, divided by the number of samples."""
    n_samples = mdm_weight.numel()
    total = logits.flatten()[:0].sum().float()  # [] exact zero in the graph
    count = 0
    for n in range(n_samples):
        labels_n = torch.where(mdm_sample == n, labels_mdm, IGNORE_INDEX)  # [b, s]
        mean_n, count_n = token_mean_cross_entropy(logits, labels_n)  # [] mean over sample n's masks
        if count_n:
            total = total + mdm_weight[n].to(total) * mean_n * count_n  # [] = weight * CE sum
            count += count_n
    return total / max(n_samples, 1), count
