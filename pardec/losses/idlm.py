"""I-DLM introspective-consistency loss: L = L_mask + s * L_clean (docs/methods/idlm.md#loss).

References: Introspective Diffusion Language Models (I-DLM), arXiv:2604.11035, §3.1 Eq. (1)-(2).

Labels come from ``pardec.data_pipelines.idlm_batch`` (logit shift already applied, ``-100`` = ignored):

* L_mask: CE summed over the supervised x_t slots (the decode pathway, q), divided by the number
  of answer tokens (docs/methods/idlm.md#loss), i.e. the number of x_0 slots with an answer target.
  Decision: this
  denominator is the same whether or not the batch builder supervises the last prompt token's x_t
  slot (``supervise_last_prompt_slot``): with it, the x_t targets are exactly the answer tokens
  and L_mask is their token mean; without it (the default, as in the official code), the x_t stream has
  one target fewer per sample (the clean anchor at P - 1) and L_mask is that sum over the answer
  count, so both settings weight each ``<|mask|>`` target identically and differ only by the anchor
  terms;
* L_clean: token-mean CE over the x_0 slots with answer targets (the introspection pathway, p);
* s: a fixed ``clean_scale`` α (0.2 in the first stride expansions) or ``"auto"``:
  s = L_mask.detach() / (L_clean.detach() + 1e-8), a constant per step (no gradient through s).

A stream with no supervised slot (e.g. every sample is prompt only) contributes an exact zero that
stays in the autograd graph (zero gradients, never NaN); with ``"auto"`` s is then 0.
"""

from __future__ import annotations

import torch

from pardec.losses.cross_entropy import token_mean_cross_entropy

AUTO = "auto"


def idlm_loss(
    logits: torch.Tensor,
    labels_mask_stream: torch.Tensor,
    labels_clean_stream: torch.Tensor,
    clean_scale: float | str = AUTO,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss and floats to log (``l_mask``, ``l_clean``, ``scale``, ``n_answer_tokens``).

    ``logits``: ``[b, s, V]`` over the packed ``[x_t | x_0]`` rows; labels: ``[b, s]``.
    ``clean_scale``: ``"auto"`` or a fixed α >= 0.
    """
    if logits.shape[:2] != labels_mask_stream.shape or logits.shape[:2] != labels_clean_stream.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match labels {tuple(labels_mask_stream.shape)} / "
            f"{tuple(labels_clean_stream.shape)}"
        )
    auto = _check_scale(clean_scale)

    # 1. Introspection pathway: CE on x_0 slots with answer targets (the AR objective); n_clean is
    #    the number of answer tokens.
    l_clean, n_clean = token_mean_cross_entropy(logits, labels_clean_stream)  # []

    # 2. Decode pathway: CE summed over the supervised x_t slots, divided by the answer count.
    l_mask, n_mask = token_mean_cross_entropy(logits, labels_mask_stream)  # []
    if n_mask > n_clean:
        raise ValueError(
            f"labels_mask_stream has {n_mask} targets but labels_clean_stream only {n_clean} answer targets; "
            "x_t targets must be a subset of the answer targets (build them with pardec.data_pipelines.idlm_batch)"
        )
    if n_mask != n_clean:
        l_mask = l_mask * (n_mask / n_clean)  # sum / n_answer_tokens  []

    # 3. Scale of the clean term: fixed α, or the detached loss ratio (auto-balance).
    scale = l_mask.detach() / (l_clean.detach() + 1e-8) if auto else float(clean_scale)  # [] or float

    # 4. Total.
    total = l_mask + scale * l_clean  # []
    logs = {
        "l_mask": float(l_mask.detach()),
        "l_clean": float(l_clean.detach()),
        "scale": float(scale),
        "n_answer_tokens": float(n_clean),
    }
    return total, logs


def _check_scale(clean_scale: float | str) -> bool:
    if isinstance(clean_scale, str):
        if clean_scale != AUTO:
            raise ValueError(f"clean_scale must be {AUTO!r} or a number >= 0, got {clean_scale!r}")
        return True
    if not clean_scale >= 0:
        raise ValueError(f"clean_scale must be {AUTO!r} or a number >= 0, got {clean_scale!r}")
    return False
