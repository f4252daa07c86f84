"""Masked-diffusion (MDM) loss: weighted CE over the masked answer tokens
(docs/methods/mdm.md#loss-weights-and-normalisation).

References: LLaDA, Large Language Diffusion Models, arXiv:2502.09992 (Eq. 3, 1/t weight);
Dream 7B, arXiv:2508.15487 (logit shift, CART weighting).

Inputs come from ``pardec.data_pipelines.mdm_batch`` (logit shift applied; one weight per target, 1/t or
CART). Two normalisations, both offered because the anchors differ:

* ``batch`` (default; ZHZisZZ/dllm): ``sum_i w_i CE_i / N``, N = maskable answer tokens of the
  whole micro-batch. Every answer token counts equally, as in the AR token mean, so the loss scale
  does not depend on how answers of different lengths are grouped, and a short answer with a
  small t (weight 1/t up to 1000) cannot dominate a batch as it can when divided by its own length;
* ``sample`` (LLaDA): ``(1/B') sum_samples (sum_{i in s} w_i CE_i / N_s)``, B' = samples with at
  least one maskable answer token: every sample counts equally whatever its length.

Without any target (every sample drew no mask) the loss is an exact zero that stays in the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pardec.common.config_fields import Choice
from pardec.common.constants import IGNORE_INDEX


class Normalization(Choice):
    """batch (sum / answer tokens of the micro-batch) | sample (per-sample mean, then / B)."""

    batch = "batch"
    sample = "sample"


def mdm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    sample_ids: torch.Tensor,
    n_answer: torch.Tensor,
    normalization: str = "batch",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss and floats to log (``n_targets``, ``n_answer_tokens``, ``unweighted_ce``).

    ``logits``: ``[r, s, V]``; ``labels``, ``weights``, ``sample_ids``: ``[r, s]``;
    ``n_answer``: ``[n]`` maskable answer tokens per sample (indexed by ``sample_ids``).
    """
    if logits.shape[:2] != labels.shape or labels.shape != weights.shape or labels.shape != sample_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, weights {tuple(weights.shape)} and "
            f"sample_ids {tuple(sample_ids.shape)} do not match"
        )
    normalization = Normalization(normalization)  # ValueError naming the choices

    # 1. The slots that carry a target (the query before a masked answer token).
    keep = labels != IGNORE_INDEX  # [r, s]
    n_targets = int(keep.sum())
    n_total = int(n_answer.sum())
    if n_targets == 0:
        zero = logits.flatten()[:0].sum().float()  # [] in the graph, zero gradients
        return zero, {"n_targets": 0.0, "n_answer_tokens": float(n_total), "unweighted_ce": 0.0}

    # 2. Per-token CE of those slots only, in float32.
    ce = F.cross_entropy(logits[keep].float(), labels[keep], reduction="none")  # [m]
    weighted = weights[keep].to(ce.dtype) * ce  # [m]

    # 3. Normalise.
    if normalization == "batch":
        loss = weighted.sum() / n_total  # []
    else:
        owner = sample_ids[keep]  # [m]
        per_sample = torch.zeros(n_answer.numel(), dtype=ce.dtype, device=ce.device)  # [n]
        per_sample = per_sample.index_add(0, owner, weighted)  # [n]
        has_answer = n_answer > 0  # [n]
        loss = (per_sample[has_answer] / n_answer[has_answer].to(ce.dtype)).mean()  # []
    return loss, {"n_targets": float(n_targets), "n_answer_tokens": float(n_total),
                  "unweighted_ce": float(ce.detach().mean())}
