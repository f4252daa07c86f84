"""Jacobi Forcing loss: L = L_pc + w * L_AR (docs/methods/jacobi_forcing.md#loss, paper Eq. 8-9).

References: Fast and Accurate Causal Parallel Decoding using Jacobi Forcing, arXiv:2512.14681,
§3.1 Eq. (8)-(9), App. C.

Inputs come from ``pardec.data_pipelines.jacobi_batch`` (one forward over the packed rows):

* L_pc, progressive consistency: for every (student, teacher) pair, KL(p_teacher || p_student)
  between the clean logit (teacher, detached: theta^- = stopgrad(theta)) and the noisy logit at
  the same block offset; summed over a block's pairs ("KL aggregated across the tokens in a
  block", Eq. 5), averaged over the blocks of the micro-batch (the 1/N of Eq. 8), blocks without
  a pair included. The offsets and their logit-shift alignment are documented in
  ``pardec.data_pipelines.jacobi_batch``.
* L_AR: token-mean next-token CE over the clean stream's labels (generated answer tokens, EOS
  included; pads and post-EOS slots ignored).
* w: ``ar_weight`` (the reference code uses 10).

The reference trainer uses a soft cross-entropy, which differs from the KL by the teacher's
entropy (a constant: same gradient), and divides a token mean by the number of blocks again; here
the value is the KL itself and the normalisation is the paper's. Empty cases give an exact zero
that stays in the graph (never NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pardec.losses.cross_entropy import token_mean_cross_entropy


def jacobi_forcing_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    pc_student_index: torch.Tensor,
    pc_teacher_index: torch.Tensor,
    n_blocks: int | torch.Tensor,
    ar_weight: float = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss and floats to log (``l_pc``, ``l_ar``, ``n_pc_pairs``, ``n_ar_tokens``).

    ``logits``: ``[b, s, V]``; ``labels``: ``[b, s]``; ``pc_*_index``: ``[K]`` flat indices into
    ``b * s``; ``n_blocks``: blocks in the micro-batch (>= 1 when K > 0).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if pc_student_index.shape != pc_teacher_index.shape:
        raise ValueError(
            f"student index {tuple(pc_student_index.shape)} != teacher index {tuple(pc_teacher_index.shape)}"
        )
    if ar_weight < 0:
        raise ValueError(f"ar_weight must be >= 0, got {ar_weight}")
    n_blocks = int(n_blocks)
    flat = logits.flatten(0, 1)  # [b*s, V]

    # 1. Gather the K (student, teacher) rows; only those are upcast to float32.
    n_pairs = pc_student_index.numel()
    if n_pairs and n_blocks < 1:
        raise ValueError(f"{n_pairs} consistency pairs but n_blocks={n_blocks}")
    student = flat[pc_student_index].float()  # [K, V]
    teacher = flat[pc_teacher_index].detach().float()  # [K, V]

    # 2. KL(teacher || student) per pair: sum_v p_t (log p_t - log p_s).
    log_p_teacher = F.log_softmax(teacher, dim=-1)  # [K, V]
    log_p_student = F.log_softmax(student, dim=-1)  # [K, V]
    kl = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True).sum(-1)  # [K]

    # 3. L_pc: summed within blocks, averaged over blocks.
    l_pc = kl.sum() / max(n_blocks, 1) if n_pairs else flat[:0].sum().float()  # []

    # 4. L_AR: token-mean CE over the labelled slots.
    l_ar, n_ar = token_mean_cross_entropy(logits, labels)  # []

    # 5. Total.
    total = l_pc + ar_weight * l_ar  # []
    logs = {"l_pc": float(l_pc.detach()), "l_ar": float(l_ar.detach()), "n_pc_pairs": float(n_pairs),
            "n_ar_tokens": float(n_ar)}
    return total, logs
