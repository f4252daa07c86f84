"""Attention masks written once, as predicates, and materialised per backend.

A *mask predicate* is a FlexAttention ``mask_mod``: ``allowed(b, h, q_idx, kv_idx) -> bool``,
built by a factory from per-token metadata tensors (segment ids, stream ids, block ids, ...), each
shaped ``[batch, seq]``. The predicate body may use only tensor indexing and elementwise ops, so
the very same function serves two backends:

* :func:`additive_mask` broadcasts index grids through it and returns a float additive mask
  ``[b, 1, q, kv]`` (0 where allowed, dtype-min elsewhere) for SDPA / eager attention. A boolean
  4-D mask is silently misread as additive by transformers' eager path, so only float is produced.
  Decoders use it too, with ``kv_cache_len`` = the KV-cache length: a step's query i is then key
  ``kv_cache_len + i``, so the predicate sees the same (q, kv) indices as over the whole sequence.
* ``flex_block_mask`` hands it to a compiled ``create_block_mask`` (GPU) and returns a
  ``BlockMask`` for ``attn_implementation`` ``flex_attention`` or ``pardec_flex``.

``AttentionSpec`` carries (predicate factory, metadata) inside a batch, so collators stay free of
any backend choice and the model wrapper materialises the mask it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from pardec.common.attention import FLEX_BACKENDS
from pardec.common.errors import ConfigError

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskFactory = Callable[..., MaskMod]

DENSE_BACKENDS = ("sdpa", "eager")
FLASH_BACKEND = "flash_attention_2"


@dataclass
class AttentionSpec:
    """A mask predicate factory plus the ``[b, s]`` metadata it closes over.

    ``factory`` must be a module-level function (picklable for DataLoader workers) called as
    ``factory(**metadata)``. ``causal_document`` marks specs that are exactly a per-segment causal
    mask, which flash-attn can run from position ids alone (varlen).
    """

    factory: MaskFactory
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)
    causal_document: bool = False

    def mask_mod(self) -> MaskMod:
        return self.factory(**self.metadata)

    def to(self, device: torch.device | str) -> "AttentionSpec":
        moved = {k: v.to(device) for k, v in self.metadata.items()}
        return AttentionSpec(self.factory, moved, self.causal_document)

    @property
    def shape(self) -> tuple[int, int]:
        first = next(iter(self.metadata.values()))
        return int(first.shape[0]), int(first.shape[1])


def dense_bool_mask(
    mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device=None, kv_cache_len: int = 0
) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full (b, q, kv) grid by broadcasting. Returns ``[b, q, kv]`` bool.

    Query i is evaluated as key index ``kv_cache_len + i`` (0 for a full-sequence mask; the cache
    length for a decoding step whose keys are ``[cache | step inputs]``).
    """
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    h = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(kv_cache_len, kv_cache_len + q_len, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    allowed = mask_mod(b, h, q, kv)
    return allowed.expand(batch, q_len, kv_len)


def additive_mask(
    mask_mod: MaskMod,
    batch: int,
    q_len: int,
    kv_len: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    kv_cache_len: int = 0,
) -> torch.Tensor:
    """Float additive mask ``[b, 1, q, kv]`` of ``mask_mod``: 0 where allowed, ``finfo.min`` elsewhere
    (queries offset by ``kv_cache_len`` as in :func:`dense_bool_mask`)."""
    allowed = dense_bool_mask(mask_mod, batch, q_len, kv_len, device, kv_cache_len)  # [b, q, kv]
    additive = torch.zeros(batch, 1, q_len, kv_len, dtype=dtype, device=device)
    return additive.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)


def dense_additive_mask(spec: AttentionSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`additive_mask` ``[b, 1, s, s]`` of a whole-sequence spec."""
    batch, seq = spec.shape
    device = next(iter(spec.metadata.values())).device
    return additive_mask(spec.mask_mod(), batch, seq, seq, dtype, device)


def require_dense_attention(model, where: str) -> None:
    """``where`` passes a 4-D float mask: the model must run sdpa or eager attention."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in DENSE_BACKENDS:
        raise ConfigError(
            f"{where} passes a 4-D float attention mask, which needs attn_implementation in {DENSE_BACKENDS}; "
            f"the model uses {impl!r}: load it with attn_implementation=sdpa"
        )


@lru_cache(maxsize=1)
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


def flex_block_mask(spec: AttentionSpec, compile: bool = True, block_size: int | None = None):
    """FlexAttention ``BlockMask`` from the same predicate (GPU path; compiled once, cached per shape
    by ``torch.compile``'s shape specialisation). ``block_size``: the side of its sparsity tiles
    (None: torch's 128); the flex kernel's tiles must divide it."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = spec.shape
    device = next(iter(spec.metadata.values())).device
    build = _compiled_create_block_mask() if compile else create_block_mask
    tiles = {} if block_size is None else {"BLOCK_SIZE": block_size}
    return build(spec.mask_mod(), batch, None, seq, seq, device=device, **tiles)


def materialize(spec: AttentionSpec | None, attn_implementation: str, dtype: torch.dtype):
    """The ``attention_mask`` argument a transformers model expects for this backend.

    flash_attention_2 cannot take an arbitrary mask: only causal-document specs are accepted, and
    the model then derives the varlen boundaries from the (restarting) position ids.
    """
    if spec is None:
        return None
    if attn_implementation in DENSE_BACKENDS:
        return dense_additive_mask(spec, dtype)
    if attn_implementation in FLEX_BACKENDS:
        return flex_block_mask(spec)
    if attn_implementation == FLASH_BACKEND:
        if not spec.causal_document:
            raise ValueError(
                f"attn_implementation={FLASH_BACKEND!r} supports only per-segment causal masks; "
                f"the mask {spec.factory.__name__!r} needs 'flex_attention' (GPU) or 'sdpa' (CPU)."
            )
        return None
    raise ValueError(f"unknown attn_implementation {attn_implementation!r}")


def within_sample(segment_ids: torch.Tensor, allowed: MaskMod) -> MaskMod:
    """``allowed`` restricted to query/key pairs of the same packed sample, plus the diagonal.

    ``segment_ids``: ``[b, s]`` sample id of each token inside its row, ``-1`` for padding. Every
    packed-row mask is ``within_sample(segment_ids, <its rule inside one sample>)``: nothing crosses
    samples, and padding attends only to itself (a finite softmax row; its outputs are never used)::

        q\\kv  a0 a1 b0 pad          (rows a and b: two samples; allowed = everything)
        a0     x  x  .  .
        a1     x  x  .  .
        b0     .  .  x  .
        pad    .  .  .  x
    """

    def mask_mod(b, h, q_idx, kv_idx):
        same_sample = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (segment_ids[b, q_idx] >= 0)
        return (same_sample & allowed(b, h, q_idx, kv_idx)) | (q_idx == kv_idx)

    return mask_mod


def causal(b, h, q_idx, kv_idx):
    """Plain token-causal attention by buffer index (``kv <= q``)."""
    return kv_idx <= q_idx


def causal_document(segment_ids: torch.Tensor) -> MaskMod:
    """Token-causal attention inside each packed segment; padding (segment ``-1``) sees only itself.

    ``segment_ids``: ``[b, s]``, e.g. ``0 0 0 1 1 -1``::

        q\\kv  a0 a1 a2 b0 b1 pad
        a0     x  .  .  .  .  .
        a1     x  x  .  .  .  .
        a2     x  x  x  .  .  .
        b0     .  .  .  x  .  .
        b1     .  .  .  x  x  .
        pad    .  .  .  .  .  x
    """
    return within_sample(segment_ids, causal)


def causal_document_spec(segment_ids: torch.Tensor) -> AttentionSpec:
    return AttentionSpec(causal_document, {"segment_ids": segment_ids}, causal_document=True)
