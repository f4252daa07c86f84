"""Batch-1 decode steps: over a ``DynamicCache`` (eager), or over a ``StaticCache`` with each step
width captured once as a CUDA graph (``cuda_graphs: true``: the AR, ISD, Jacobi, multi-block, ReFusion
and MDM decoders but COVER, whose full forwards have their own static form:
:mod:`pardec.inference.decoders.override_forward`).

Both kinds have one interface: ``reset(context)``, ``forward(ids, block, offsets=None, context=None)
-> logits [q, V]`` (the ``q`` ids after the cached keys, ``block [1, 1, q, q]`` the additive mask over
their own keys; ``context [1, 1, q, length]`` the additive mask over the cached keys, None: every query
sees every cached key; ``offsets``: each id's position relative to the first uncached one, ``0 .. q-1``
by default, e.g. branches that share positions, negative for a position before it), ``crop(length)``,
``keep(base, start, count)`` (the first ``base`` keys, then ``count`` keys moved down from ``start``),
``select(indices)`` (the keys at ``indices``, in that order) and ``length``.

Why graphs: an eager decode step of a small model on a GPU is bound by kernel launches (SmolLM2-135M on an
H100: 19-53 forwards per second whatever their width, docs/results/real_gpu.md), so a parallel
decoder's TPF does not reach its TPS. With every tensor a step touches at a fixed address (a
``StaticCache``, static input buffers), the step is recorded once per query width ``q`` and
replayed: the host then issues two small copies and one graph launch per forward.

Conventions (one sequence, batch 1):

* keys ``0 .. length-1`` of the static cache are the committed tokens; a step feeds ``q`` tokens at
  positions ``length .. length+q-1`` and transformers' ``StaticLayer.update`` writes their K/V at
  its ``cumulative_length`` (set to ``length`` inside the step). :meth:`StaticSteps.crop` only moves
  ``length`` back: entries past it are stale, hidden by the mask and overwritten by later steps.
* a step's K/V go to the ``q`` slots after the committed keys whatever the ids' positions (the
  ``offsets`` only move the rotary positions), as a ``DynamicCache`` appends them.
* the step's additive mask ``[1, 1, q, max_len]``: the caller's ``context`` (0 without one) on the
  committed keys, the caller's ``block [1, 1, q, q]`` (additive, over the step's own keys) on columns
  ``length .. length+q-1``, the dtype's minimum elsewhere. So a step computes what the same forward
  over a ``DynamicCache`` of ``length`` entries with mask ``cat([context, block], -1)`` computes (the
  decoders' eager path).
* the positions, the mask and the cache lengths are computed on the device from a 0-dim ``length``
  buffer inside the step, so a replay needs no host work but copying ``ids`` and ``length``.
* on a CUDA device with ``graphs=True`` each width is warmed up twice on a side stream and captured
  (``torch.cuda.CUDAGraph``: the eager kernels replayed, so the numbers equal the eager static
  step's); elsewhere the same step runs eagerly (what the CPU tests compare with the
  ``DynamicCache`` decoders). The warm-up writes K/V at ``length ..``, past the committed keys.
* widths: a step of ``q`` tokens runs at :func:`step_width` ``(q)``: ``q`` up to :data:`SMALL`, else
  ``q`` rounded up to a multiple of it, the extra queries padding (the last id repeated, hidden from
  the real queries, each seeing the committed keys and itself); their K/V land past the step's ``q``
  and are stale. So a decoder whose widths vary (multi-block: the chain and its recycled candidates,
  up to ``1 + (K + m) n`` tokens) has a few widths, not one per token count, and
  :meth:`StaticSteps.prepare` (called by :meth:`StepsPool.get` with the decoder's widest step) has
  every one captured before the first decode: none is captured while a decode is timed
  (docs/results/real_gpu.md, 2026-11-28: captures that fell inside timed problems).

Needs transformers' ``StaticLayer`` with a device-side ``cumulative_length`` (transformers >= 5).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache, StaticCache

from pardec.common.kv_cache import cache_argument, crop_cache, select_cache_entries
from pardec.inference.decoders.base import model_device, prefill

BUCKET = 512  # static cache lengths are multiples of this: a longer problem re-allocates rarely
SMALL = 8  # step widths up to this run as they are; wider ones are padded to a multiple of it


def step_width(q: int) -> int:
    """The width a static step of ``q`` tokens runs at (the module doc's "widths")."""
    return q if q <= SMALL else -(-q // SMALL) * SMALL


def causal_block(q: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, q, q]`` over a step's own keys (0 visible, dtype min hidden)."""
    hidden = torch.ones((q, q), dtype=torch.bool, device=device).triu(1)
    return torch.zeros((1, 1, q, q), dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)


def dynamic_step(model, cache: DynamicCache, ids: Sequence[int], block: torch.Tensor,
                 offsets: Sequence[int] | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
    """One eager forward of ``ids`` after ``cache`` (its K/V appended), mask ``cat([context, block], -1)``
    (``context`` default 0: every cached key visible), positions ``cache_len + offsets`` (``offsets``
    default ``0 .. q-1``); logits ``[q, V]``."""
    device = model_device(model)
    cache_len = cache.get_seq_length()
    ids_t = torch.tensor([list(ids)], device=device)  # [1, q]
    rel = torch.arange(len(ids), device=device) if offsets is None else torch.tensor(list(offsets), device=device)
    positions = (cache_len + rel).unsqueeze(0)  # [1, q]
    if context is None:
        mask = torch.nn.functional.pad(block, (cache_len, 0))  # [1, 1, q, cache_len + q]
    else:
        mask = torch.cat([context, block], -1)  # [1, 1, q, cache_len + q]
    out = model(input_ids=ids_t, attention_mask=mask, position_ids=positions, **cache_argument(cache), use_cache=True)
    return out.logits[0]  # [q, V]


class DynamicSteps:
    """The eager steps the decoders run by default: a ``DynamicCache`` grown and cropped."""

    def __init__(self, model):
        self.model, self.device = model, model_device(model)
        self.cache: DynamicCache | None = None

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def reset(self, context: Sequence[int]) -> None:
        ids = torch.tensor([list(context)], dtype=torch.long, device=self.device)  # [1, L]
        self.cache = prefill(self.model, ids, torch.ones_like(ids))

    def forward(self, ids: Sequence[int], block: torch.Tensor, offsets: Sequence[int] | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        return dynamic_step(self.model, self.cache, ids, block, offsets, context)

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)

    def keep(self, base: int, start: int, count: int) -> None:
        """Keep keys ``[0, base)`` then ``[start, start + count)``; drop the rest."""
        if start == base or count == 0:
            self.crop(base + count)
            return
        select_cache_entries(self.cache, torch.cat([torch.arange(base), torch.arange(start, start + count)]))

    def select(self, indices: Sequence[int]) -> None:
        """Keep the keys at ``indices``, in that order."""
        select_cache_entries(self.cache, torch.tensor(list(indices), dtype=torch.long))


class StaticSteps:
    """One sequence's KV cache of ``max_len`` positions and its decode steps (see the module doc)."""

    def __init__(self, model, max_len: int, graphs: bool):
        self.model, self.max_len = model, max_len
        self.device, self.dtype = model_device(model), model.dtype
        self.graphs = graphs and self.device.type == "cuda"
        self.length = 0
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self._length = torch.zeros((), dtype=torch.long, device=self.device)  # committed keys, on the device
        self._cols = torch.arange(max_len, device=self.device)  # [max_len]
        self._steps: dict[int, _Step] = {}
        self._layer_lengths: list[torch.Tensor] = []  # each StaticLayer's write offset, once allocated
        self._run(_Step(self, 1))  # allocates the cache (lazily, at its first update) before any capture
        self._layer_lengths = [layer.cumulative_length for layer in self.cache.layers]
        if any(not isinstance(t, torch.Tensor) for t in self._layer_lengths):
            raise RuntimeError("StaticSteps needs transformers' StaticLayer with a tensor cumulative_length (>= 5.4)")

    def reset(self, context: Sequence[int]) -> None:
        """Start a new sequence: the cache holds ``context`` (prefilled eagerly, causal; may be empty)."""
        self.length = 0
        if context:
            self.forward(context, causal_block(len(context), self.dtype, self.device), capture=False)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` keys (later ones become stale)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop to {length} keys: the cache holds {self.length}")
        self.length = length

    def keep(self, base: int, start: int, count: int) -> None:
        """Keep keys ``[0, base)`` then ``[start, start + count)`` (copied down in place, so the
        captured graphs keep their addresses); later ones become stale."""
        if not (0 <= base <= start and start + count <= self.length):
            raise ValueError(f"keep {count} keys from {start} after {base}: the cache holds {self.length}")
        if start > base and count:
            for layer in self.cache.layers:
                for kv in (layer.keys, layer.values):  # [1, heads, max_len, head_dim]
                    kv[:, :, base:base + count] = kv[:, :, start:start + count].clone()
        self.length = base + count

    def select(self, indices: Sequence[int]) -> None:
        """Keep the keys at ``indices``, in that order (gathered in place from the first index that
        moves, so the captured graphs keep their addresses); later ones become stale."""
        indices = list(indices)
        if any(not 0 <= i < self.length for i in indices):
            raise ValueError(f"select keys {indices}: the cache holds {self.length}")
        first = next((k for k, i in enumerate(indices) if i != k), len(indices))
        if first < len(indices):
            moved = torch.tensor(indices[first:], dtype=torch.long, device=self.device)
            for layer in self.cache.layers:
                for kv in (layer.keys, layer.values):  # [1, heads, max_len, head_dim]
                    kv[:, :, first:len(indices)] = kv.index_select(2, moved)
        self.length = len(indices)

    def prepare(self, widest: int) -> None:
        """Allocate every step width up to ``step_width(widest)`` (on CUDA with graphs: capture it), so
        that no width is captured during a decode. Empties the cache (the captures write keys from slot
        0): call it before :meth:`reset`."""
        self.length = 0
        self._length.fill_(0)
        for width in sorted({step_width(q) for q in range(1, widest + 1)}):
            if width not in self._steps and width <= self.max_len:
                step = self._steps[width] = _Step(self, width)
                if self.graphs:
                    step.capture()

    def forward(self, ids: Sequence[int], block: torch.Tensor, offsets: Sequence[int] | None = None,
                context: torch.Tensor | None = None, capture: bool = True) -> torch.Tensor:
        """Logits ``[q, V]`` of ``ids`` (q tokens) after the committed keys, masked by ``context
        [1, 1, q, length]`` (None: all visible) over those and ``block [1, 1, q, q]`` over their own,
        at positions ``length + offsets`` (default ``0 .. q-1``); their K/V are appended (``length +=
        q``). The step runs at ``step_width(q)`` (padded; exactly ``q`` where the padding would not fit
        the cache). ``capture=False`` runs eagerly at ``q`` without keeping the width's buffers (a
        prefill's one-off width)."""
        q = len(ids)
        if self.length + q > self.max_len:
            raise ValueError(f"a step of {q} tokens after {self.length} overflows the static cache of {self.max_len}")
        width = step_width(q) if capture else q
        if self.length + width > self.max_len:
            width = q  # no room for the padding at the cache's end
        step = self._steps.get(width) if capture else None
        if step is None:
            step = _Step(self, width)
            if capture:
                self._steps[width] = step
        rel = torch.arange(q) if offsets is None else torch.tensor(list(offsets), dtype=torch.long)  # [q]
        pad = width - q
        step.ids.copy_(torch.tensor([list(ids) + [ids[-1]] * pad], dtype=torch.long), non_blocking=False)
        step.offsets.copy_(torch.cat([rel, rel[-1:].expand(pad)]))  # [width]
        if pad:
            step.block.fill_(torch.finfo(self.dtype).min)  # [1, 1, width, width]
            step.block[:, :, :q, :q] = block
            padding = torch.arange(q, width)
            step.block[0, 0, padding, padding] = 0.0  # a padding query sees itself (and the committed keys)
        else:
            step.block.copy_(block)
        if context is not None:  # padding queries see every committed key
            step.context.zero_()
            step.context[:, :, :q, : self.length] = context
            step.has_context = True
        elif step.has_context:
            step.context.zero_()
            step.has_context = False
        self._length.fill_(self.length)
        if capture and self.graphs:
            if step.graph is None:
                step.capture()
            step.graph.replay()
            logits = step.logits[:, :q].clone()  # the graph's output buffer is rewritten by its next replay
        else:
            logits = self._run(step)[:, :q]
        self.length += q
        return logits[0]  # [q, V]

    def _run(self, step: "_Step") -> torch.Tensor:
        """The step itself, every input read from ``step``'s buffers and ``self._length``."""
        q = step.q
        rel = self._cols - self._length  # [max_len]: key index relative to the step's first token
        own = step.block[0, 0][:, rel.clamp(0, q - 1)]  # [q, max_len]
        minimum = torch.finfo(self.dtype).min
        step_keys = torch.where(rel < q, own, minimum)  # [q, max_len]
        mask = torch.where(rel < 0, step.context[0, 0], step_keys).to(self.dtype)  # [q, max_len]
        slots = self._length + torch.arange(q, device=self.device)  # [q]: where the step's K/V go
        for length in self._layer_lengths:
            length.copy_(self._length)
        out = self.model(input_ids=step.ids, attention_mask=mask[None, None],
                         position_ids=(self._length + step.offsets)[None], cache_position=slots,
                         **cache_argument(self.cache), use_cache=True)
        return out.logits  # [1, q, V]


class _Step:
    """The static buffers of one width, and its CUDA graph once captured."""

    def __init__(self, steps: StaticSteps, q: int):
        self.steps, self.q = steps, q
        self.ids = torch.zeros((1, q), dtype=torch.long, device=steps.device)
        self.offsets = torch.arange(q, device=steps.device)  # positions relative to the committed length
        self.block = torch.zeros((1, 1, q, q), dtype=steps.dtype, device=steps.device)
        self.context = torch.zeros((1, 1, q, steps.max_len), dtype=steps.dtype, device=steps.device)  # committed keys
        self.has_context = False  # whether ``context`` holds a caller's mask (else zeros)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.steps._run(self)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.steps._run(self)


class StepsPool:
    """A decoder's steps for one sample: fresh :class:`DynamicSteps` by default; with
    ``cuda_graphs`` the model's one :class:`StaticSteps`, shared by every decoder in the process (so
    graphs captured during a warm-up are replayed by the timed run), re-allocated only when a sample
    needs a longer cache (lengths rounded up to :data:`BUCKET`)."""

    _static: "weakref.WeakKeyDictionary[torch.nn.Module, StaticSteps]" = weakref.WeakKeyDictionary()

    def __init__(self, cuda_graphs: bool):
        self.cuda_graphs = cuda_graphs

    def get(self, model, needed: int, widest: int = 1) -> DynamicSteps | StaticSteps:
        """Steps for a sample of at most ``needed`` keys (prompt, new tokens and one step's slack) whose
        steps are at most ``widest`` tokens wide (static steps: every width prepared, the cache empty)."""
        if not self.cuda_graphs:
            return DynamicSteps(model)
        steps = self._static.get(model)
        if steps is None or steps.max_len < needed:
            self._static[model] = steps = StaticSteps(model, -(-needed // BUCKET) * BUCKET, graphs=True)
        steps.prepare(widest)
        return steps
