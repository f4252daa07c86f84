"""The decoder contract every validation decoder (AR, ISD, Jacobi, COVER, ...) implements.

Counting conventions (docs/methods/conventions.md#counting), fixed here once for every method:

- **Prefill** is one forward over the prompt *without its last token* (``prompt[:-1]``). It only
  writes the KV cache and yields nothing, so it is excluded from the counts and from the timed
  loop. The last prompt token is the first input of the decoding loop; this is what makes AR
  greedy with a KV cache take exactly one forward per token (TPF = 1), and it gives ISD's
  bootstrap forward (last prompt token + N-1 masks) the same status as every later step.
- **forwards** (NFE) = model forwards of the decoding loop spent on a sample. A batched decoder
  counts, per sample, the batched forwards in which that sample's row took part.
- **committed** = tokens appended to the output, up to and including EOS, never anything after.
- **wall_time_s** = time of the decoding loop, measured with the device synchronised
  (``torch.cuda.synchronize``) at both ends. A batched decoder splits its batch's loop time
  across the batch's samples in proportion to their forwards, so the times sum to the loop time.

Lifecycle, driven by ``pardec.inference.evaluate.evaluate`` (one run = one eval set):

1. ``decoder = build_decoder(cfg, tokenizer)``: the validated config dataclass and the tokenizer. The
   evaluator then refuses a checkpoint whose kind (attention, logit shift, ``<|mask|>``) is not among
   the decoder's declared :attr:`Decoder.checkpoint_kinds`, before anything is decoded
   (``pardec.inference.decoders.registry.check_checkpoint_kind``).
2. ``decoder.use_auxiliary({...})``: the auxiliary models the decoder's config names (the fields
   listed in :attr:`Decoder.auxiliary_fields`, e.g. FlashDLM's AR guide ``decoder.guide=<export>``),
   loaded once by validation and handed over before decoding; a named one that is missing is a
   :class:`ConfigError` naming ``decoder.<field>``.
3. ``with decoder.prepare(model): decoder.decode(...)``: ``prepare`` is a context manager for
   whatever the decoder changes on the model for its run (an attention function registered with
   transformers' ``AttentionInterface``, hooks, ...) and must undo on exit, also on error; the
   evaluator leaves it before the AR greedy reference run, so the reference always sees the model
   as loaded. The default changes nothing. The evaluator runs every ``decode`` (the reference's
   too) under :func:`pardec.common.kv_cache.cached_step_attention`: SDPA without cuDNN attention, which
   plans each new step shape on the host.
4. ``decoder.summarize(records)``: decoder-specific aggregates over the run's per-sample records
   (e.g. ISD acceptance), merged into the metrics; the default adds nothing.

:meth:`Decoder.decode` takes a batch of prompts and returns one :class:`DecodeResult` per prompt.
Decoders that work per sample (batch 1, own KV-cache handling) subclass :class:`PerSampleDecoder`
and implement ``decode_one``. Defaults that depend on how the model was converted (ISD stride,
Jacobi block size, the mask id, ...) come from the checkpoint's
:class:`pardec.common.metadata.CheckpointMetadata`, never from guesses.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from pardec.common.config_fields import check_config, ranged
from pardec.common.errors import ConfigError
from pardec.common.kv_cache import cache_argument


@dataclass
class DecoderConfig:
    """Keys shared by every decoder; a decoder's own config dataclass subclasses this."""

    # Registry name (``pardec.inference.decoders.registry``): ar, ...
    name: str = "ar"
    max_new_tokens: int = ranged(256, ge=1)
    # Prompts per ``decode`` call; per-sample decoders receive the chunk and loop over it.
    batch_size: int = ranged(1, ge=1)
    # Sampling seed; sample i uses a generator seeded from (seed, i), independent of sharding.
    seed: int = ranged(0, ge=0)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids, up to and including EOS
    forwards: int  # decoding forwards spent on this sample (NFE), prefill excluded
    committed: int  # tokens committed (== len(tokens))
    wall_time_s: float  # this sample's share of the synchronised decoding-loop time
    hit_eos: bool
    stats: dict[str, Any] = field(default_factory=dict)  # decoder-specific (acceptance, ...)


class Decoder(ABC):
    name: str = "base"
    # Config fields naming auxiliary checkpoints (export directories) the decoder needs besides the
    # model under evaluation, e.g. ("guide",); a field left null is not loaded.
    auxiliary_fields: tuple[str, ...] = ()
    # The checkpoint kinds (pardec.common.metadata.CHECKPOINT_KINDS) the decoder can decode; every
    # decoder declares them, and a checkpoint of another kind is refused before decoding
    # (pardec.inference.decoders.registry.check_checkpoint_kind).
    checkpoint_kinds: tuple[str, ...] = ()

    def __init__(self, cfg: DecoderConfig, tokenizer):
        check_config(cfg, "decoder")  # every declared range and choice of the decoder's config
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.auxiliary: dict[str, Any] = {}

    @classmethod
    def auxiliary_checkpoints(cls, cfg: DecoderConfig) -> dict[str, str]:
        """``{field: export directory}`` for each auxiliary field ``cfg`` sets."""
        return {f: getattr(cfg, f) for f in cls.auxiliary_fields if getattr(cfg, f, None)}

    def use_auxiliary(self, models: Mapping[str, Any]) -> None:
        """Take the loaded auxiliary models, keyed by field; exactly those the config names."""
        wanted = set(self.auxiliary_checkpoints(self.cfg))
        missing, unexpected = sorted(wanted - set(models)), sorted(set(models) - wanted)
        if missing:
            raise ConfigError(
                f"decoder {self.name!r} needs the model(s) named by {[f'decoder.{f}' for f in missing]}, "
                "which were not loaded (validation loads them from the config)"
            )
        if unexpected:
            raise ConfigError(f"decoder {self.name!r} got auxiliary models it does not use: {unexpected}")
        self.auxiliary = dict(models)

    @contextlib.contextmanager
    def prepare(self, model) -> Iterator[None]:
        """Changes to ``model`` for this decoder's run, undone on exit (default: none)."""
        yield

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Decoder-specific aggregates over a run's records (default: none)."""
        return {}

    @property
    def is_ar_greedy(self) -> bool:
        """True for the AR greedy reference itself (its agreement with AR greedy is not measured)."""
        return False

    @abstractmethod
    def decode(
        self,
        model,
        prompts: Sequence[Sequence[int]],
        eos_token_ids: Collection[int],
        seeds: Sequence[int],
    ) -> list[DecodeResult]:
        """Decode each prompt (non-empty token ids); ``seeds[i]`` seeds prompt i's sampling."""


class PerSampleDecoder(Decoder):
    """A decoder that handles one prompt per call (batch 1)."""

    def decode(self, model, prompts, eos_token_ids, seeds) -> list[DecodeResult]:
        return [self.decode_one(model, list(p), eos_token_ids, s) for p, s in zip(prompts, seeds, strict=True)]

    @abstractmethod
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        """Decode one prompt."""


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LoopTimer:
    """Wall time of a decoding loop with the device synchronised at start and stop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = 0.0
        self.elapsed = 0.0

    def __enter__(self) -> "LoopTimer":
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self.start


def prefill(model, context_ids: torch.Tensor, attention_mask: torch.Tensor) -> DynamicCache:
    """Write the KV cache of ``context_ids [b, s]`` (the prompts without their last token).

    Positions are explicit: ``cumsum(mask) - 1`` per row, so left padding does not shift them.
    An empty context (every prompt has one token) returns an empty cache without a forward.
    """
    cache = DynamicCache(config=model.config)
    if context_ids.shape[1] > 0:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [b, s]
        model(
            input_ids=context_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_argument(cache),
            use_cache=True,
            logits_to_keep=1,
        )
    return cache


def forbid_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``logits [..., V]`` with ``<|mask|>``'s logit set to -inf, in place: a decoder never proposes
    the mask token, whatever hook the model was loaded with; a vocabulary without ``mask_id`` (an
    AR guide's) is left as it is."""
    if mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")
    return logits
