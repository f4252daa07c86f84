"""KV-cache helpers shared by trajectory collection and the decoders."""

from __future__ import annotations

from transformers import DynamicCache


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
