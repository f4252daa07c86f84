"""Token selection shared by decoders: greedy argmax or sampling with temperature, top-k, top-p.

:func:`probs_from_logits` returns the *transformed* distribution (temperature, then top-k, then
top-p, renormalised). Speculative decoders (ISD sampling mode) must draft from and verify against
this same transformed distribution for their acceptance rule to be exact.

Reproducibility: every sample draws from its own ``torch.Generator`` seeded by
:func:`sample_seed` from (config seed, sample index), so outputs do not depend on the batch size,
on which other samples share a batch, or on how the eval set is sharded across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pardec.common.config_fields import Choice


class SamplingMode(Choice):
    """``decoder.mode`` of the decoders that can sample: greedy (argmax) | sample (temperature, top-k, top-p)."""

    greedy = "greedy"
    sample = "sample"


@dataclass
class SamplingParams:
    """Built from a decoder config, whose declared ranges hold (temperature > 0, top_k >= 0, top_p in (0, 1])."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off


def sample_seed(seed: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` under config ``seed`` (distinct pairs, distinct streams)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def make_generators(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [b, V]`` -> sampling distribution ``[b, V]`` (float32) after temperature/top-k/top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [b, V]
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def select_tokens(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits [b, V]`` -> ``[b]``; row i samples with ``generators[i]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = probs_from_logits(logits, params)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
