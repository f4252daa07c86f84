"""ISD acceptance metrics: the paper's TPF formula on measured acceptance (docs/methods/idlm.md#tpf-formula).

References: I-DLM, Introspective Diffusion Language Models, arXiv:2604.11035 (Appendix B.1).

**P_k** (paper: "P_k = p^k" for a uniform per-token acceptance p) is the probability that the
first k drafts of a *verify* step are all accepted, k = 1..N-1. Measured from the decoder's
counters: ``P_k = accepted[k-1] / verify_steps``, where ``accepted[k-1]`` counts the verify steps
in which draft k was reached and accepted. The conditional per-position rate is
``accepted[k-1] / reached[k-1]`` (``reached[k-1]``: verify steps in which draft k was examined).

**TPF formula** (paper Eq. 5, renewal argument): a cycle is one propose step (1 exact token) then
verify steps until the first rejection; a verify step commits ``1 + (accepted drafts)`` tokens
(accepted drafts + the corrected or bonus token), so it commits ``1 + P_1 + ... + P_{N-1}`` tokens
in expectation, and ends the chain with probability ``1 - P_{N-1}``. Hence

    TPF_N = (2 + P_1 + ... + P_{N-2}) / (2 - P_{N-1})          (N, at P = 1; 1, at P = 0)

It is exact when the number of propose steps equals the number of rejections. A finite sample
differs by its ends: the bootstrap is an extra propose step, and EOS / ``max_new_tokens``
truncate the last step (tokens verified but not committed), so ``isd_tpf_measured`` (Σ committed
/ Σ forwards, docs/methods/conventions.md#counting) sits slightly below ``isd_tpf_predicted`` on short
generations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def isd_tpf(cumulative_acceptance: Sequence[float]) -> float:
    """Paper Eq. 5 from ``[P_1, ..., P_{N-1}]`` (length N-1 >= 1, each in [0, 1])."""
    probs = list(cumulative_acceptance)
    if not probs:
        raise ValueError("isd_tpf needs P_1..P_{N-1} (stride N >= 2), got an empty list")
    if any(not 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {probs}")
    return (2.0 + sum(probs[:-1])) / (2.0 - probs[-1])


def isd_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the ISD ``stats`` of every record and derive P_k, per-position rates and both TPFs.

    Returns ``isd_stride``, ``isd_propose_steps``, ``isd_verify_steps``, ``isd_P_k`` and
    ``isd_accept_rate_k`` (k = 1..N-1; None without verify steps / without a reached draft k),
    ``isd_tpf_predicted`` (Eq. 5 on the measured P_k; None without verify steps) and
    ``isd_tpf_measured`` (Σ committed / Σ forwards).
    """
    if not records:
        raise ValueError("isd_summary got no records")
    strides = {r["stats"]["stride"] for r in records}
    if len(strides) != 1:
        raise ValueError(f"isd_summary needs records of one stride, got strides {sorted(strides)}")
    stride = strides.pop()
    verify = sum(r["stats"]["verify_steps"] for r in records)
    reached = [sum(r["stats"]["reached"][k] for r in records) for k in range(stride - 1)]
    accepted = [sum(r["stats"]["accepted"][k] for r in records) for k in range(stride - 1)]
    cumulative = [a / verify for a in accepted] if verify else None
    forwards = sum(r["forwards"] for r in records)

    summary: dict[str, Any] = {
        "isd_stride": stride,
        "isd_propose_steps": sum(r["stats"]["propose_steps"] for r in records),
        "isd_verify_steps": verify,
    }
    for k in range(1, stride):
        summary[f"isd_P_{k}"] = cumulative[k - 1] if cumulative else None
    for k in range(1, stride):
        summary[f"isd_accept_rate_{k}"] = accepted[k - 1] / reached[k - 1] if reached[k - 1] else None
    summary["isd_tpf_predicted"] = isd_tpf(cumulative) if cumulative else None
    summary["isd_tpf_measured"] = sum(r["committed"] for r in records) / forwards if forwards else None
    return summary
