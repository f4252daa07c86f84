"""KV-cache helpers shared by trajectory collection and the decoders."""

from __future__ import annotations

from transformers import DynamicCache


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop every KV entry from index ``length`` on (a no-op when the cache is not longer)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5.x: a negative count of trailing entries to remove
