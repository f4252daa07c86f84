"""FlexAttention compiled once per shape, for the packed structured masks of training (GPU).

``attn_implementation=pardec_flex`` runs ``torch.nn.attention.flex_attention`` on the ``BlockMask``
that ``pardec.masks.core.flex_block_mask`` builds from a recipe's mask predicate, through a function
registered with transformers' ``AttentionInterface``. It differs from transformers' own
``flex_attention`` entry (transformers 5.x, read from its code) in three ways; on an H100 it was
1.03-1.15x faster with 0.3-1.1 GiB less peak memory at 4k-16k tokens
(``benchmarks/results/mask_backends_flex_entries.md``):

* it is compiled with ``dynamic=False``: transformers compiles ``flex_attention`` with automatic
  dynamic shapes, so the second sequence length a process sees recompiles it into a dynamic-shape
  kernel that stays in use for every later length;
* it passes no ``score_mod``: transformers passes a closure (adding an optional dense score mask,
  soft-capping and position bias) that is an identity here;
* grouped-query attention runs inside the kernel (``enable_gqa``) for any head ratio: transformers
  repeats K/V to the query heads whenever the query head count is not a power of two (14 heads in
  Qwen2.5-0.5B).

Each distinct (batch, heads, query length, key length) compiles once; training packs rows to a fixed
length, so a run compiles once. Without a ``BlockMask`` (a model called with no mask) it builds
transformers' causal ``BlockMask``, like the built-in entry.

:func:`configure` sets FlexAttention's ``kernel_options`` (tile sizes, warps, stages, TMA; passed to
torch as they are, so torch names a key it does not know), the ``torch.compile`` mode and whether K/V
heads are repeated to the query heads for every later call; training sets them from
``model.flex_kernel_options``, ``model.flex_compile_mode`` and ``model.flex_repeat_kv``.
``pardec/benchmarks/flex_kernels.py`` measures the choices on a GPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from typing import Any, Mapping

import torch
import torch._functorch.config as aot_autograd_config
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flex_attention_mask

from pardec.common.attention import COMPILED_FLEX_BACKEND

# The kernel choice torch.compile's max-autotune picked for head size 64 in bf16 on an H200 (a Jacobi
# Forcing streams row of 16k tokens, benchmarks/results/flex_kernels_autotune.md): forward tiles of
# 64 x 64, backward 32 x 64 / 64 x 32, 3 stages and 4 warps in both.
AUTOTUNED_HOPPER_HEAD_DIM_64 = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
                                "BLOCK_N2": 32, "num_stages": 3, "num_warps": 4}
# The activation-memory budget under which the compiler repeats K/V heads again in backward instead of
# keeping the repeated copies (see :func:`repeat_partition`). Keeping the query, the output and the
# K/V heads as given is (2g + 2) / 4g <= 0.75 of keeping the repeated copies, for any group g >= 2,
# so 0.9 is met by recomputing the repeat alone. At 0.3 the partitioner also reruns the forward kernel
# in backward, and tests/test_flex_attention.py fails (g = 2, 3, 7; CPU).
REPEAT_RECOMPUTE_MEMORY_BUDGET = 0.9
_KERNEL_OPTIONS: dict[str, Any] = {}
_COMPILE_MODE: str | None = None
_REPEAT_KV = False


def configure(kernel_options: Mapping[str, Any] | None = None, compile_mode: str | None = None,
              repeat_kv: bool = False) -> None:
    """FlexAttention ``kernel_options`` and ``torch.compile`` mode for every later call (None: torch's
    defaults for the GPU; e.g. ``{"BLOCK_M": 128, "BLOCK_N": 64}`` or mode
    ``"max-autotune-no-cudagraphs"``). ``repeat_kv``: copy K/V to every query head before the kernel
    instead of grouped-query attention inside it. Flex's backward runs one program per K/V tile and
    K/V head, which loops over the head group; with K/V heads repeated it runs one per query head, a
    shorter longest program on a GPU with more SMs than K/V tiles x K/V heads. The repeat is compiled
    with the kernel and done again in backward (:func:`repeat_partition`), so the copies are not kept."""
    global _COMPILE_MODE, _REPEAT_KV
    _KERNEL_OPTIONS.clear()
    _KERNEL_OPTIONS.update(kernel_options or {})
    _REPEAT_KV = repeat_kv
    if compile_mode != _COMPILE_MODE:
        _COMPILE_MODE = compile_mode
        _compiled_attend.cache_clear()


def attend(query, key, value, block_mask, scale, kernel_options, group):
    """FlexAttention after repeating each K/V head ``group`` times (1: grouped-query attention inside
    the kernel). ``query`` ``[b, h, q, d]``, ``key``/``value`` ``[b, h_kv, kv, d]``; returns ``[b, h, q, d]``."""
    if group > 1:  # query head i reads K/V head i // group, as enable_gqa does
        key, value = repeat_kv(key, group), repeat_kv(value, group)  # [b, h, kv, d]
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                          enable_gqa=query.shape[1] != key.shape[1], kernel_options=kernel_options)


def repeat_partition(group: int) -> AbstractContextManager:
    """Where :func:`attend` is compiled (at its first call for a shape), what it keeps for backward.
    torch.compile's default partition keeps the repeated K/V copies: a copy that feeds the backward
    kernel counts as materialised there and is never recomputed. Under an activation-memory budget
    below 1 its knapsack partition keeps the K/V heads as given and repeats them again in backward,
    so a layer's repeated copies live through its own backward only."""
    if group == 1:
        return nullcontext()
    return aot_autograd_config.patch(activation_memory_budget=REPEAT_RECOMPUTE_MEMORY_BUDGET)


@lru_cache(maxsize=1)
def _compiled_attend():
    return torch.compile(attend, dynamic=False, mode=_COMPILE_MODE)


def compiled_flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query`` ``[b, h, q, d]``, ``key``/``value`` ``[b, h_kv, kv, d]``,
    ``attention_mask`` a ``BlockMask``; returns ``([b, q, h, d], None)``."""
    if dropout > 0:
        raise ValueError(f"attn_implementation={COMPILED_FLEX_BACKEND!r} has no attention dropout; set it to 0")
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(
            f"attn_implementation={COMPILED_FLEX_BACKEND!r} needs a BlockMask (pardec.masks.core.flex_block_mask), "
            f"got {type(attention_mask).__name__}"
        )
    group = query.shape[1] // key.shape[1] if _REPEAT_KV else 1
    with repeat_partition(group):
        out = _compiled_attend()(query, key, value, attention_mask, scaling, dict(_KERNEL_OPTIONS) or None, group)
    return out.transpose(1, 2).contiguous(), None  # [b, q, h, d]


def register() -> None:
    """Make :data:`COMPILED_FLEX_BACKEND` a valid ``attn_implementation`` (idempotent)."""
    AttentionInterface.register(COMPILED_FLEX_BACKEND, compiled_flex_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(COMPILED_FLEX_BACKEND, flex_attention_mask)
