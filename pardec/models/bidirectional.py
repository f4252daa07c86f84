"""Switch a transformers model's attention modules to non-causal (``is_causal = False``).

A bidirectional (MDM) model always receives an explicit 4-D mask, and SDPA only falls back to a
causal kernel when the mask is missing; setting the modules' ``is_causal`` flag to False as well
(docs/methods/mdm.md#attention) means a forgotten mask can no longer turn the model silently causal on the paths that
read the flag (sdpa, flash-attn, flex).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def set_is_causal(model, value: bool) -> dict:
    """Set ``is_causal`` on every submodule that has it; returns ``{module: previous value}``."""
    previous = {}
    for module in model.modules():
        if hasattr(module, "is_causal") and isinstance(module.is_causal, bool):
            previous[module] = module.is_causal
            module.is_causal = value
    return previous


@contextlib.contextmanager
def non_causal(model) -> Iterator[None]:
    """``is_causal = False`` inside the block, the previous flags restored on exit (also on error)."""
    previous = set_is_causal(model, False)
    try:
        yield
    finally:
        for module, value in previous.items():
            module.is_causal = value
