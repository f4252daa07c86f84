"""Shared machinery of the masked-diffusion (MDM) decoders: fixed length, semi-AR blocks, KV caches.

References: LLaDA arXiv:2502.09992 (semi-AR blocks, low-confidence remasking); Fast-dLLM
arXiv:2505.22618 (threshold decoding, prefix KV cache); FlashDLM arXiv:2505.21467 (FreeCache,
AR-guided diffusion).

The sequence is ``prompt + L x <|mask|>`` (L = ``max_new_tokens``, a multiple of ``block_size``);
the L generated positions are decoded block by block, left to right, each block until none of its
positions is masked. The checkpoint must be an MDM export (:class:`CheckpointMetadata`: ``attention``
bidirectional or block, ``logit_shift`` true, a ``mask_token_id``); its attention predicate
(``pardec.masks.mdm``) is the training one and is always passed as an explicit 4-D float mask, and the
attention modules' ``is_causal`` flags are off for the run (``prepare``). With the logit shift the
token at position j is read from the output at j - 1.

**Forwards.** One step = one forward over ``x[c:w]`` after a KV cache holding exactly positions
``0 .. c-1`` (``c = 0``: no cache); its outputs at ``s-1 .. e-2`` give the current block ``[s, e)``.
The window ends at ``w`` = the sequence end with bidirectional attention, and at the end of the
attention block holding ``e - 1`` with block attention: no position right of it can reach the
current block there, so feeding it would change no logit and cost compute (every mode, the
baseline's full recompute too; "everything right of it" below then means nothing).
Cache modes:

* ``none`` (LLaDA): c = 0 every step, full recompute;
* ``prefix`` (Fast-dLLM): the first step of each block is a full forward (c = 0) that refreshes
  the cache; the cache keeps positions ``< s - 1`` and the block's other steps feed
  ``[x_{s-1}, block, everything right of it]``. Keeping ``x_{s-1}`` (the last committed token) out
  of the cache lets its output predict the block's first token, so nothing is force-committed at
  the refresh (the official Dream variant commits the block's first token there instead);
* ``freecache`` (FlashDLM): the first forward is full; afterwards positions left of
  ``s - 1`` are frozen and every step feeds ``[x_{s-1}, current block, blocks to its right]`` (the
  window shrinks block by block). When a block completes, its K/V are frozen either

  - ``refresh`` (default, more faithful): recomputed with the block's final tokens by the *next*
    block's first step, whose window starts one block earlier (``[x_{s'-1}, finished block,
    current block, ...]``), then frozen: no extra forward;
  - ``freeze_last`` (the official flash-dlm code): taken from the block's own last-step forward, so
    the tokens unmasked in that final step stay cached with ``<|mask|>`` K/V.

  The prompt (but its last token) is frozen from the first full forward.

**Decode steps and CUDA graphs.** Every DLM forward (COVER's aside) runs through
:mod:`pardec.inference.decoders.decode_steps` (:meth:`BlockRun.window_forward`): the cache keeps the
first ``c`` keys of the last forward (``c = 0``: emptied) and the window ``x[c:n]`` is one step with
the window's own part of the mask, ``full_mask[c:n, c:n]``; with either attention every position of
the window sees every position left of it, which is the steps' convention for the cached keys. The
steps are a ``DynamicCache`` by default; with ``cuda_graphs: true`` (batch 1) the model's static
cache, every width up to the decoder's widest forward (:meth:`MDMDecoder.widest_step`) captured as
a CUDA graph before the first step (the two are compared token for token in the tests). COVER's
override forwards (full forwards, no cache) have their own static form and graphs
(:mod:`pardec.inference.decoders.override_forward`).

**``<|mask|>`` is never proposed.** Every DLM forward of an MDM decoder goes through
:meth:`BlockRun.counted` (after the steps in :meth:`BlockRun.window_forward`, after COVER's override
forwards), which sets the mask id's logit to -inf (:func:`forbid_mask`) before any decoder reads
it, so no draft, commit, Replace or confidence ever involves ``<|mask|>``, however the
model was loaded (``pardec.inference.checkpoint.load_checkpoint`` installs the same exclusion as a
hook, so a loaded checkpoint's figures do not change). ``<|mask|>`` is an input symbol: a position
given it would stay masked and be drafted again at every step, without end.

No separate prefill: a bidirectional prompt's K/V depend on the generated region, so every model
forward is a decoding forward and is counted (the prefill of ``prompt[:-1]`` of docs/methods/conventions.md#counting
applies to the guide of :mod:`pardec.inference.decoders.mdm_guided`, which is causal).

**Stopping and counting.** Committed tokens never change. Decoding stops as soon as every position
up to and including the first generated EOS is committed (nothing after it is ever output), or all
blocks are done. ``tokens`` = the generated ids up to and including that EOS (all L without one);
``forwards`` counts every forward of the run (the guide's too); ``stats`` holds ``dlm_forwards``,
``guide_forwards`` and the cache mode; :meth:`MDMDecoder.summarize` reports per-sample means and
the TPF over all forwards and over DLM forwards alone.

**Revision metrics** (issue 11), in every MDM decoder's ``stats`` so tables compare them: ``steps``
(DLM forwards), ``revisions``, ``remasks``, ``replaces``, ``flip_flops``, ``effective_revisions``
(:class:`RevisionLog`; all zero for the non-revocable decoders here, whose commits never change)
and ``tokens_per_step``; ``summarize`` adds their per-sample means and the pooled
effective-revision ratio (:func:`revision_summary`). The revocable decoders are
:mod:`pardec.inference.decoders.cover`, :mod:`pardec.inference.decoders.wino` and
:mod:`pardec.inference.decoders.saber`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pardec.common.config_fields import Choice, ranged
from pardec.common.constants import METADATA_KEY
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import MDM_BIDIRECTIONAL, MDM_BLOCK, CheckpointMetadata, model_where
from pardec.inference.decoders.base import (
    DecoderConfig,
    DecodeResult,
    LoopTimer,
    PerSampleDecoder,
    forbid_mask,
    model_device,
)
from pardec.inference.decoders.decode_steps import SMALL, DynamicSteps, StaticSteps, StepsPool
from pardec.masks.core import additive_mask, require_dense_attention
from pardec.masks.mdm import ATTENTIONS, BLOCK, answer_block_ids, mdm_mask
from pardec.models.bidirectional import non_causal
from pardec.models.loading import mask_token_id

NONE, PREFIX, FREECACHE = "none", "prefix", "freecache"
REPLACE, REMASK = "replace", "remask"
DEFAULT_BLOCK_SIZE = 32


class FreecacheMode(Choice):
    """refresh: a finished block's K/V recomputed with its final tokens | freeze_last (official)."""

    refresh = "refresh"
    freeze_last = "freeze_last"


@dataclass
class MDMDecoderConfig(DecoderConfig):
    name: str = "mdm_lowconf"
    # The fixed generation length L (a multiple of block_size); output is cut after the first EOS.
    max_new_tokens: int = ranged(256, ge=1)
    # Semi-AR block size; null = the checkpoint's attention_block_size (block models), else 32.
    block_size: int | None = ranged(None, ge=1)
    # FreeCache: freeze the K/V of blocks left of the current one (FlashDLM).
    freecache: bool = False
    # refresh (default: a finished block's K/V recomputed with its final tokens) | freeze_last (official)
    freecache_mode: FreecacheMode = FreecacheMode.refresh
    # Each step width as a CUDA graph over a static cache (module doc, "CUDA graphs"; on a GPU, so that
    # TPS follows TPF; elsewhere the same static steps run eagerly). The guide's steps too.
    cuda_graphs: bool = False


@dataclass(frozen=True)
class MDMInfo:
    """What a decoder needs from an MDM checkpoint's metadata."""

    attention: str
    attention_block_size: int | None
    mask_id: int


def default_block_size(info: MDMInfo) -> int:
    """The decoding block when none is given: a block model's attention block, else 32."""
    return info.attention_block_size if info.attention == BLOCK else DEFAULT_BLOCK_SIZE


def mdm_info(model, tokenizer=None) -> MDMInfo:
    """The checkpoint's MDM record; :class:`CheckpointError` naming the keys if it is not an MDM export."""
    meta = CheckpointMetadata.of_model(model)
    where = model_where(model)
    if meta.attention not in ATTENTIONS or meta.logit_shift is None or meta.mask_token_id is None:
        raise CheckpointError(
            f"{where} is not an MDM export: it records {METADATA_KEY}.recipe={meta.recipe!r}, "
            f"attention={meta.attention!r}, logit_shift={meta.logit_shift!r}, mask_token_id={meta.mask_token_id!r}; "
            f"MDM decoders need attention in {ATTENTIONS}, a logit_shift and a mask_token_id (convert with recipe=mdm)"
        )
    if not meta.logit_shift:
        raise CheckpointError(f"{where}: {METADATA_KEY}.logit_shift=false; the MDM decoders read position j from "
                              "output j-1 (the Dream shift recipe=mdm trains)")
    return MDMInfo(meta.attention, meta.attention_block_size, mask_token_id(model, tokenizer))


class MDMDecoder(PerSampleDecoder):
    """Semi-AR block decoding of an MDM; subclasses choose what a step commits (:meth:`select`)."""

    # The checkpoint kinds it decodes: MDM exports (shifted logits, <|mask|>), both attentions.
    checkpoint_kinds = (MDM_BIDIRECTIONAL, MDM_BLOCK)
    # The cache mode when freecache is off (threshold decoding overrides it with its option).
    default_cache = NONE
    # Why a decoder cannot use FreeCache (it needs one full forward per step), or None when it can.
    no_freecache_reason: str | None = None

    def __init__(self, cfg: MDMDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        if cfg.freecache and self.no_freecache_reason:
            raise ConfigError(f"config key 'decoder.freecache' = true: {self.no_freecache_reason}; use freecache=false")
        self.steps = StepsPool(cfg.cuda_graphs)
        self.kv_snapshots: list[dict[str, Any]] | None = None  # tests: set to [] to record frozen K/V

    @property
    def cache_mode(self) -> str:
        return FREECACHE if self.cfg.freecache else self.default_cache

    def block_size(self, info: MDMInfo) -> int:
        size = self.cfg.block_size if self.cfg.block_size is not None else default_block_size(info)
        if self.cfg.max_new_tokens % size:
            raise ConfigError(
                f"config key 'decoder.max_new_tokens' = {self.cfg.max_new_tokens} is not a multiple of the block size "
                f"{size} (decoder.block_size): MDM decoding fills a fixed length of whole blocks"
            )
        return size

    @contextlib.contextmanager
    def prepare(self, model) -> Iterator[None]:
        """Check the checkpoint once and switch the attention modules to non-causal for the run."""
        mdm_info(model, self.tokenizer)
        with non_causal(model):
            yield

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        n = max(len(records), 1)
        dlm = sum(r["stats"]["dlm_forwards"] for r in records)
        guide = sum(r["stats"]["guide_forwards"] for r in records)
        committed = sum(r["committed"] for r in records)
        return {
            "dlm_forwards_per_sample": dlm / n,
            "guide_forwards_per_sample": guide / n,
            "tpf_dlm": committed / dlm if dlm else 0.0,
            "tpf_all": committed / (dlm + guide) if dlm + guide else 0.0,
            "cache_mode": self.cache_mode,
            **revision_summary(records),
        }

    # -- subclass hooks --------------------------------------------------------------------------

    def begin(self, run: BlockRun, prompt: list[int]) -> None:
        """Per-sample setup before the timed loop (the guide's prefill)."""

    def widest_step(self, n: int, block: int) -> int:
        """The most tokens one DLM forward feeds, for a sequence of ``n`` and decoding blocks of
        ``block`` (``cuda_graphs``: every width up to it is captured before the first step)."""
        return n

    def select(self, logits: torch.Tensor, masked: torch.Tensor, step: int, run: BlockRun) -> dict[int, int]:
        """``{block offset: token}`` to commit this step; ``logits [B, V]`` predict the block's
        positions, ``masked [B]`` marks the positions still masked (at least one)."""
        raise NotImplementedError

    def start_run(self, model, prompt: list[int], what: str) -> BlockRun:
        """The checks and set-up every MDM decode starts with: a non-empty prompt, a dense attention
        backend (``what`` names the decoder in the error), an MDM checkpoint, the block layout."""
        if not prompt:
            raise ValueError("MDM decoding needs at least one prompt token (got an empty prompt)")
        require_dense_attention(model, what)
        info = mdm_info(model, self.tokenizer)
        return BlockRun(self, model, info, prompt, self.cfg.max_new_tokens, self.block_size(info), model_device(model))

    # -- the loop ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        run = self.start_run(model, prompt, "MDM decoding")
        device = run.x.device
        self.begin(run, prompt)
        eos = set(eos_token_ids)

        with LoopTimer(device) as timer:
            for b in range(run.n_blocks):
                step = 0
                while run.masked_in_block(b).any():
                    logits = run.dlm_step(b, step)  # [B, V]
                    masked = run.masked_in_block(b)
                    commits = self.select(logits, masked, step, run)
                    run.commit(b, commits)
                    step += 1
                    if run.done(eos):
                        break
                if run.done(eos):
                    break

        return self.finish_run(run, eos, timer.elapsed)

    def finish_run(self, run: BlockRun, eos: set[int], elapsed: float, log: RevisionLog | None = None,
                   **extra: Any) -> DecodeResult:
        """The result every MDM decode ends with: the tokens up to and including the first EOS, and
        the stats all MDM decoders report (forwards, steps, ``log``'s revision counters, tokens per
        step, ``run.extra``), plus the decoder's own ``extra`` counters."""
        tokens = run.output(eos)
        revisions = (log or RevisionLog()).summary(run.x.tolist(), run.info.mask_id)
        stats = {"dlm_forwards": run.dlm_forwards, "guide_forwards": run.guide_forwards, "cache_mode": self.cache_mode,
                 "block_size": run.block, "steps": run.dlm_forwards, **revisions,
                 "tokens_per_step": len(tokens) / run.dlm_forwards if run.dlm_forwards else 0.0, **run.extra, **extra}
        return DecodeResult(tokens=tokens, forwards=run.dlm_forwards + run.guide_forwards, committed=len(tokens),
                            wall_time_s=elapsed, hit_eos=bool(tokens) and tokens[-1] in eos, stats=stats)


class RevisionLog:
    """Per-sample revision counters: flip-flops as they happen, effective revisions at the end."""

    def __init__(self):
        self.events: list[tuple[int, int, str]] = []  # (position, token removed, kind)
        self.pending: dict[int, int] = {}  # re-masked position -> the token it had
        self.per_position: dict[int, int] = defaultdict(int)
        self.flip_flops = 0

    def unmask(self, pos: int, token: int) -> None:
        if pos in self.pending and self.pending.pop(pos) == token:
            self.flip_flops += 1

    def remask(self, pos: int, old: int) -> None:
        self.events.append((pos, old, REMASK))
        self.pending[pos] = old
        self.per_position[pos] += 1

    def replace(self, pos: int, old: int, new: int) -> None:
        self.events.append((pos, old, REPLACE))
        self.per_position[pos] += 1

    def summary(self, final: Sequence[int], mask_id: int) -> dict[str, int]:
        effective = sum(1 for pos, old, _ in self.events if final[pos] != mask_id and final[pos] != old)
        return {
            "revisions": len(self.events),
            "remasks": sum(1 for *_, kind in self.events if kind == REMASK),
            "replaces": sum(1 for *_, kind in self.events if kind == REPLACE),
            "flip_flops": self.flip_flops,
            "effective_revisions": effective,
        }


def revision_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-sample means and the pooled effective-revision ratio (as the paper pools them)."""
    n = max(len(records), 1)
    total = {k: sum(r["stats"].get(k, 0) for r in records)
             for k in ("steps", "revisions", "remasks", "replaces", "flip_flops", "effective_revisions")}
    committed = sum(r["committed"] for r in records)
    return {
        "steps_per_sample": total["steps"] / n,
        "revisions_per_sample": total["revisions"] / n,
        "remasks_per_sample": total["remasks"] / n,
        "replaces_per_sample": total["replaces"] / n,
        "flip_flops_per_sample": total["flip_flops"] / n,
        "effective_revision_ratio": total["effective_revisions"] / total["revisions"] if total["revisions"] else 0.0,
        "tokens_per_step": committed / total["steps"] if total["steps"] else 0.0,
    }


class BlockRun:
    """One sample's state: the token sequence, the DLM cache and the counters."""

    def __init__(self, decoder: MDMDecoder, model, info: MDMInfo, prompt: list[int], length: int, block: int, device):
        self.decoder, self.model, self.info = decoder, model, info
        self.prompt_len, self.length, self.block = len(prompt), length, block
        self.n_blocks = length // block
        self.x = torch.tensor(prompt + [info.mask_id] * length, device=device)  # [n]
        n = self.x.numel()
        positions = torch.arange(n, device=device)
        metadata = {"segment_ids": torch.zeros(1, n, dtype=torch.long, device=device),
                    "block_ids": answer_block_ids(positions, self.prompt_len, info.attention_block_size or 1)[None]}
        predicate = mdm_mask(info.attention, **metadata)
        self.full_mask = additive_mask(predicate, 1, n, n, model.dtype, device)  # [1, 1, n, n]
        widest = decoder.widest_step(n, block)
        # The DLM cache: DynamicSteps, or with cuda_graphs the model's static steps with every width prepared
        # (+ SMALL: room for a step's padding).
        self.steps: DynamicSteps | StaticSteps = decoder.steps.get(model, widest + SMALL, widest)
        self.mode = decoder.cache_mode
        self.dlm_forwards = 0
        self.guide_forwards = 0
        self.current = 0  # the block being decoded
        self.extra: dict[str, Any] = {}  # decoder-specific per-sample counters, merged into stats

    def span(self, b: int) -> tuple[int, int]:
        s = self.prompt_len + b * self.block
        return s, s + self.block

    def masked_in_block(self, b: int) -> torch.Tensor:
        s, e = self.span(b)
        return self.x[s:e] == self.info.mask_id  # [B]

    def window_start(self, b: int, step: int) -> int:
        s, _ = self.span(b)
        if self.mode == NONE:
            return 0
        if step == 0 and (self.mode == PREFIX or b == 0):
            return 0  # full forward: prefix-cache refresh, or FreeCache's initial pass
        if self.mode == FREECACHE and step == 0 and self.decoder.cfg.freecache_mode == "refresh":
            return s - self.block - 1  # re-feed the finished block (its final tokens) to refresh it
        return s - 1

    def window_end(self, e: int) -> int:
        """End of a step's window for the block ending at ``e`` (module docstring): the sequence end,
        or with block attention the end of the attention block holding position ``e - 1``."""
        n = self.x.numel()
        if self.info.attention != BLOCK:
            return n
        size = self.info.attention_block_size
        return min(n, self.prompt_len + -(-(e - self.prompt_len) // size) * size)

    def dlm_step(self, b: int, step: int) -> torch.Tensor:
        """One DLM forward for block b; logits ``[B, V]`` of the block's positions."""
        self.current = b
        s, e = self.span(b)
        c = self.window_start(b, step)
        n = self.window_end(e)
        use_cache = self.mode != NONE
        fed = self.x[c:n].clone()  # [n - c]
        # Every query of the window sees every key left of it (both attentions): the steps' convention.
        logits = self.window_forward(c, fed, self.full_mask[:, :, c:n, c:n])  # [n - c, V]
        if use_cache:
            self.after_forward(b, s, e, c, fed)
        return logits[s - 1 - c : e - 1 - c]  # [B, V]: output j-1 predicts position j

    def window_forward(self, cached: int, ids: torch.Tensor, block: torch.Tensor,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
        """One counted DLM forward through the steps (batch 1): ``ids [q]`` after the first ``cached``
        keys of the last forwards (0: none), every query seeing all of them and ``block [1, 1, q, q]``
        over the fed keys, at ``positions [q]`` (default ``cached .. cached + q - 1``); its logits
        ``[q, V]`` with ``<|mask|>`` forbidden (:func:`forbid_mask`)."""
        if cached:
            self.steps.crop(cached)
            assert self.steps.length == cached, (self.steps.length, cached)
        else:
            self.steps.reset([])
        offsets = None if positions is None else (positions - cached).tolist()
        return self.counted(self.steps.forward(ids.tolist(), block, offsets))

    def counted(self, logits: torch.Tensor) -> torch.Tensor:
        """Count one DLM forward and return its ``logits [q, V]`` with ``<|mask|>`` forbidden (every DLM
        forward: the steps', and COVER's override forwards, which run without them)."""
        self.dlm_forwards += 1
        return forbid_mask(logits, self.info.mask_id)

    @property
    def freeze_last(self) -> bool:
        return self.mode == FREECACHE and self.decoder.cfg.freecache_mode == "freeze_last"

    def after_forward(self, b: int, s: int, e: int, c: int, fed: torch.Tensor) -> None:
        """Crop the cache to what stays frozen after this forward (see the module docstring)."""
        if self.freeze_last:
            # Whether this was the block's last step is known after select(): commit() crops.
            self._pending = (b, e - 1, c, fed)
            return
        self.steps.crop(s - 1)  # prefix cache, FreeCache refresh: positions < s - 1 stay
        if self.mode == FREECACHE and c < s - 1:
            self._snapshot(b - 1, s - 1, c, fed)  # this forward refreshed block b-1 (-1: the prompt)

    def commit(self, b: int, commits: Mapping[int, int]) -> None:
        s, _ = self.span(b)
        if not commits:
            raise RuntimeError("an MDM decoding step committed nothing")
        for offset, token in commits.items():
            if self.x[s + offset] != self.info.mask_id:
                raise RuntimeError(f"position {s + offset} was committed twice")
            self.x[s + offset] = token
        if self.freeze_last:
            block, frozen_len, c, fed = self._pending
            if not self.masked_in_block(b).any():
                self.steps.crop(frozen_len)  # the block's last-step K/V, masks included
                self._snapshot(block, frozen_len, c, fed)
            else:
                self.steps.crop(s - 1)

    def _snapshot(self, block: int, frozen_len: int, c: int, fed: torch.Tensor) -> None:
        if self.decoder.kv_snapshots is None:
            return
        tokens = torch.cat([self.x[:c], fed])  # the sequence as that forward saw it
        layers = [(layer.keys[:, :, :frozen_len].clone(), layer.values[:, :, :frozen_len].clone())
                  for layer in self.steps.cache.layers]
        self.decoder.kv_snapshots.append({"block": block, "frozen_len": frozen_len, "tokens": tokens, "kv": layers})

    def done(self, eos: set[int]) -> bool:
        """Every position up to and including the first generated EOS is committed."""
        gen = self.x[self.prompt_len :].tolist()
        for token in gen:
            if token == self.info.mask_id:
                return False
            if token in eos:
                return True
        return False

    def output(self, eos: set[int]) -> list[int]:
        gen = self.x[self.prompt_len :].tolist()
        out = []
        for token in gen:
            if token == self.info.mask_id:
                break
            out.append(token)
            if token in eos:
                break
        return out
