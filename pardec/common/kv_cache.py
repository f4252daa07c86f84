"""KV-cache helpers shared by trajectory collection and the decoders."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import transformers
from packaging.version import Version
from transformers import Cache, DynamicCache

CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
"""The keyword a transformers model's forward takes its KV cache by. transformers 5.24 renamed
``past_key_values`` to ``cache`` (the old name warns with a FutureWarning and is announced to go in
5.40); 5.18-5.23, inside our pin, know only the old name."""


def cache_argument(cache: Cache | None) -> dict[str, Cache | None]:
    """``{CACHE_KEYWORD: cache}``, to pass a KV cache to a model's forward as ``model(..., **cache_argument(cache))``
    under every transformers version the pin allows."""
    return {CACHE_KEYWORD: cache}


@contextlib.contextmanager
def cached_step_attention() -> Iterator[None]:
    """SDPA without cuDNN attention, for loops of forwards over a growing KV cache; restored on exit.

    Every step of a cached decode brings a key length (and, in a parallel decoder, a query count)
    the process may not have seen yet, and cuDNN's attention builds an execution plan for each new
    shape on the host. On an H200 (torch 2.11) SDPA sent the decoders' steps to cuDNN, and a step
    whose shape was new cost 10-14x one whose shape repeated
    (``benchmarks/results/gpu_decoding_steps.md``); with cuDNN off, the parallel decoders' forwards
    fell from 8.7-18.1 to 4.5-5.4 ms (``gpu_decoding_decoding_h200_cudnn.md`` against
    ``gpu_decoding_decoding.md``). The kernels left (flash, memory-efficient, math) plan nothing per
    shape. Other kernel restrictions in force stay as they are; on CPU, where there is no cuDNN
    attention, this changes nothing.
    """
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop every KV entry from index ``length`` on (a no-op when the cache is not longer)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5.x: a negative count of trailing entries to remove


def select_cache_entries(cache: DynamicCache, index) -> None:
    """Keep only the KV entries at ``index`` (a 1-D long tensor of sequence indices), in that order,
    in every layer: reorders and drops entries in one gather (``crop_cache`` is the prefix case)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows: ``(ids [b, s], attention_mask [b, s])`` with s = longest row."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)
