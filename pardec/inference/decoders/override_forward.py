"""COVER's forwards: the whole sequence under the K/V override (:mod:`pardec.models.kv_override`),
eagerly, or (``cuda_graphs: true``) from static buffers, captured once per sequence length as a CUDA
graph.

COVER keeps no KV cache: each step is one forward of all ``n`` positions, so the decode steps of
:mod:`pardec.inference.decoders.decode_steps` (a cache, and steps after it) do not fit. What changes
from one of its forwards to the next has a fixed shape for a sequence: the ids ``[n]``, the seeds
``[n]`` and the injected K/V of every layer ``[1, h_kv, n, d]``; the additive mask ``[1, 1, n, n]``
changes from one sequence to the next (with block attention it depends on the prompt length).
:class:`StaticOverrideForward` holds each of them in a buffer and runs the override in every forward:
a forward without seeds has all-false seeds, which computes the plain attention bit for bit (the
kv_override module doc), so the eager forwards and the static ones decode the same (the tests compare
them token for token). On a CUDA device the forward is warmed up twice on a side stream and captured
(``torch.cuda.CUDAGraph``); elsewhere the same forward runs eagerly.

A captured forward's outputs live in the graph's memory and the next replay rewrites them: the logits
are cloned; the step's ``recorded`` K/V and ``attention`` must be read (or copied) before the next
forward, as COVER does (``remember_mask_kv`` copies what it keeps; the previous step's K/V are copied
into the static cache before the replay that reads them).

:class:`OverrideForwards` hands a decoder the forward for one sequence: a fresh :class:`EagerOverrideForward`
by default; with ``cuda_graphs`` the model's :class:`StaticOverrideForward` of that length (and settings), kept
for the process (at most :data:`KEPT`, the oldest dropped first), so a later sequence of the same
length replays the captured graph. It is built before a decode is timed: no capture falls inside one.
"""

from __future__ import annotations

import weakref

import torch

from pardec.inference.decoders.base import model_device
from pardec.models.kv_override import KVOverrideStep

KEPT = 16  # static forwards (and graphs) a model keeps: sequence lengths, times settings

KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # per layer index, (key, value) [1, h_kv, n, d]


class EagerOverrideForward:
    """One sequence's forwards, each with a fresh :class:`KVOverrideStep` (the override only when there
    are seeds and a cache)."""

    def __init__(self, model, mask: torch.Tensor, shift: int, attention_layer: int, cached_for: str):
        self.model, self.mask = model, mask
        self.shift, self.attention_layer, self.cached_for = shift, attention_layer, cached_for
        n = mask.shape[-1]
        self.positions = torch.arange(n, device=mask.device)[None]  # [1, n]

    def __call__(self, ids: torch.Tensor, seeds: torch.Tensor | None, cached: KV | None
                 ) -> tuple[torch.Tensor, KVOverrideStep]:
        """Logits ``[n, V]`` of ``ids [n]`` and the step (recorded K/V, attention); ``seeds [n]`` bool
        and ``cached`` the injected K/V, or both None: no override."""
        step = KVOverrideStep(seeds=None if seeds is None else seeds[None], cached=cached, shift=self.shift,
                              attention_layer=self.attention_layer, cached_for=self.cached_for)
        out = self.model(input_ids=ids[None], position_ids=self.positions, attention_mask=self.mask, kv_override=step)
        return out.logits[0], step


class StaticOverrideForward:
    """The forwards of sequences of ``n`` positions from static buffers (see the module doc)."""

    def __init__(self, model, n: int, shift: int, attention_layer: int, cached_for: str, graphs: bool):
        self.model = model
        device = model_device(model)
        self.graphs = graphs and device.type == "cuda"
        self.ids = torch.zeros((1, n), dtype=torch.long, device=device)
        self.positions = torch.arange(n, device=device)[None]  # [1, n]
        self.mask = torch.zeros((1, 1, n, n), dtype=model.dtype, device=device)
        self.step = KVOverrideStep(seeds=torch.zeros((1, n), dtype=torch.bool, device=device), shift=shift,
                                   attention_layer=attention_layer, cached_for=cached_for)
        self._run()  # without a cache (no override): the shapes of every layer's K/V
        self.step.cached = {layer: (torch.zeros_like(k), torch.zeros_like(v)) for layer, (k, v) in
                            self.step.recorded.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if self.graphs:
            self._capture()

    def _run(self) -> torch.Tensor:
        return self.model(input_ids=self.ids, position_ids=self.positions, attention_mask=self.mask,
                          kv_override=self.step).logits[0]  # [n, V]

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def __call__(self, ids: torch.Tensor, seeds: torch.Tensor | None, cached: KV | None
                 ) -> tuple[torch.Tensor, KVOverrideStep]:
        """As :meth:`EagerOverrideForward.__call__`; the step is this object's (its ``recorded`` and
        ``attention`` valid until the next call)."""
        self.ids[0].copy_(ids)
        if seeds is None or cached is None:
            self.step.seeds.zero_()  # no seed: the plain attention
        else:
            self.step.seeds[0].copy_(seeds)
            for layer, (key, value) in cached.items():
                static_key, static_value = self.step.cached[layer]
                static_key.copy_(key)
                static_value.copy_(value)
        if self.graph is None:
            return self._run(), self.step
        self.graph.replay()
        return self.logits.clone(), self.step  # the graph's output is rewritten by its next replay


class OverrideForwards:
    """A COVER decoder's forwards for one sequence (see the module doc)."""

    # Per model, the static forwards by (length, shift, attention layer, which queries see the cache).
    _static: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StaticOverrideForward]]" = (
        weakref.WeakKeyDictionary())

    def __init__(self, cuda_graphs: bool):
        self.cuda_graphs = cuda_graphs

    def get(self, model, mask: torch.Tensor, shift: int, attention_layer: int, cached_for: str
            ) -> EagerOverrideForward | StaticOverrideForward:
        """The forwards of a sequence with additive mask ``mask [1, 1, n, n]``."""
        if not self.cuda_graphs:
            return EagerOverrideForward(model, mask, shift, attention_layer, cached_for)
        kept = self._static.setdefault(model, {})
        key = (mask.shape[-1], shift, attention_layer, cached_for)
        forward = kept.get(key)
        if forward is None:
            if len(kept) >= KEPT:
                del kept[next(iter(kept))]
            kept[key] = forward = StaticOverrideForward(model, *key, graphs=True)
        forward.mask.copy_(mask)
        return forward
