"""Attention implementation names, and switching a loaded model's implementation for a ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FLEX_BACKEND = "flex_attention"
# pardec's FlexAttention entry (pardec/models/flex_attention.py): static-shape compile, in-kernel GQA.
COMPILED_FLEX_BACKEND = "pardec_flex"
FLEX_BACKENDS = (FLEX_BACKEND, COMPILED_FLEX_BACKEND)


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run ``model`` (a transformers ``PreTrainedModel``) with attention ``name`` inside the block;
    the implementation it had is restored on exit, also when the block raises. Both go through
    ``set_attn_implementation``, so the mask builder that belongs to each implementation follows it."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def without_flex_attention(model) -> contextlib.AbstractContextManager:
    """SDPA in place of a FlexAttention backend inside the block (the model's own attention otherwise),
    for decoding with a model loaded for training.

    On GPU the trainer loads models whose recipes need a structured mask with FlexAttention, compiled
    for every new (batch, query length, key length): packed training rows have one shape, but a
    cached decode brings a new key length at every forward and would compile at nearly every step
    (docs/results/real_gpu.md: the first GPU Jacobi Forcing conversion, which collected through
    FlexAttention, had not finished after 6.8 minutes). Decoding is causal with at most a padding
    mask, which SDPA computes.
    """
    if model.config._attn_implementation in FLEX_BACKENDS:
        return attention_implementation(model, "sdpa")
    return contextlib.nullcontext()
