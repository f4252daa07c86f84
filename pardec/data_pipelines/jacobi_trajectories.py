"""Greedy Jacobi trajectory collection with a KV cache, sharded and resumable
(docs/methods/jacobi_forcing.md#trajectory-collection, paper §2.1).

Per prompt (``torch.no_grad``, the model in eval mode; ``batch_size`` prompts are decoded together,
in lockstep, by :func:`jacobi_trajectories`, which changes neither a prompt's drafts nor its forwards):

1. Prefill: one causal forward over the whole prompt writes its KV cache; the argmax at its last
   position is the first generated token, which is exact.
2. Block j of n tokens starts from the draft ``[first correct token] + n-1 tokens`` drawn uniformly
   (with replacement) from the prompt and the tokens generated so far, with a generator seeded by
   (seed, prompt index): a prompt's trajectory does not depend on sharding or order.
3. Jacobi iteration: one causal forward over the block's not-yet-cached tail (the cache holds the
   prompt, the earlier blocks and the block's accepted prefix) gives g_o = argmax at offset o,
   the new guess for offset o + 1. The accepted prefix grows to the longest run of state tokens
   equal to their guesses (state[0] is always exact), a; the guess g_{a-1} is exact too (the
   "+1"). The KV of the rejected tail (offsets >= a) is cropped. The next state is
   ``state[:a] + [g_{a-1}, ..., g_{n-2}]``: exactly the Jacobi update y <- argmax (Eq. 3) with the
   accepted prefix frozen. A copy of every state is stored (the reference collector appends the
   live tensor, so all its "states" alias the final one and its initial state is the fixed point).
4. The block converges when its last state is fully accepted (a = n): that state is the fixed
   point (stored both as the last state and as ``fixed_point``) and g_{n-1} is the next block's
   first token. Consecutive states always differ and the accepted prefix grows by >= 1 per
   forward, so a block takes at most n forwards.
5. Stop at EOS or at the length cap. EOS can appear anywhere in the exact prefix: the block ends
   there, ``valid_len`` = tokens up to and including EOS, and the post-EOS positions of the fixed
   point and of every stored state are set to ``pad_token_id`` (never trained on). An EOS that is
   the next block's first token gives a final block with ``valid_len`` 1 (so the AR loss still
   learns to emit EOS after the last full block). The cap: blocks are generated whole while fewer
   than ``max_new_tokens`` tokens exist, so a sample has at most ceil(max_new_tokens / n) blocks.

Check: the generated tokens must be AR greedy output. After each batch, one uncached causal
forward over every row's ``prompt + generated`` must give argmax == the next generated token at
every position. A mismatch is a :class:`TrajectoryError` naming the sample and position, unless the
chosen token's logit is within ``greedy_atol`` of the maximum (a numerical near-tie between the
cached and uncached kernels, counted in ``near_ties``). ``greedy_atol=None`` means 0 for float32
models and 0.5 (logit units) for 16-bit ones, where the two kernels round differently.

Storage, one row per prompt: ``index`` (position in the prompt list), ``prompt_ids``, ``states``
(per block, the list of states, each n ids), ``fixed_points`` (per block, n ids), ``valid_lens``,
``hit_eos``, ``forwards`` (Jacobi forwards including the prefill that yields the first token:
vanilla Jacobi TPF = generated tokens / forwards) and ``near_ties``.

Sharding: prompts are cut into shards of ``shard_size`` consecutive prompts; rank r of a world of
size W collects shards r, r + W, ... (with ``shard_size=1``, exactly prompts r::W). Each shard is
one parquet file written through ``datasets`` to a temporary name and renamed when complete, so a
restarted collection skips finished shards and never reads a partial one. ``meta.json`` records
the settings and a hash of the prompts; resuming into a directory made with other settings is an
error. :func:`load_trajectories` returns all shards as one ``datasets.Dataset`` in prompt order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from transformers import DynamicCache

from pardec.common.attention import without_flex_attention
from pardec.common.kv_cache import cache_argument, cached_step_attention, crop_cache, left_pad

log = logging.getLogger(__name__)

META_FILE = "meta.json"
FORMAT_VERSION = 1

FEATURES = datasets.Features({
    "index": datasets.Value("int64"),
    "prompt_ids": datasets.List(datasets.Value("int64")),
    "states": datasets.List(datasets.List(datasets.List(datasets.Value("int64")))),
    "fixed_points": datasets.List(datasets.List(datasets.Value("int64"))),
    "valid_lens": datasets.List(datasets.Value("int64")),
    "hit_eos": datasets.Value("bool"),
    "forwards": datasets.Value("int64"),
    "near_ties": datasets.Value("int64"),
})


class TrajectoryError(RuntimeError):
    """Collection or loading failed; the message names the sample, shard or setting."""


@dataclass(frozen=True)
class CollectSettings:
    block_size: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    seed: int = 0
    shard_size: int = 64
    greedy_atol: float | None = None
    batch_size: int = 1  # prompts decoded together (within a shard)

    def check(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"Jacobi block size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids is empty: collection needs at least one EOS id")


# ---------------------------------------------------------------------------------------------
# A batch of prompts
# ---------------------------------------------------------------------------------------------


def _forward(model, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: DynamicCache,
             keep: int = 0) -> torch.Tensor:
    """Causal forward of ``ids [b, l]`` at ``positions [b, l]`` after the cached prefix; ``mask
    [b, cached + l]`` is the padding mask of the cached and the new tokens. Returns the logits
    ``[b, l, V]``, or of the last ``keep`` positions only when ``keep > 0``."""
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(cache), use_cache=True,
                 logits_to_keep=keep).logits


@dataclass
class _Trajectory:
    """One prompt's collection in progress (a row of the batch)."""

    prompt: list[int]
    rng: np.random.Generator
    first: int = -1  # the current block's first token, exact
    forwards: int = 0
    generated: list[int] = field(default_factory=list)
    states: list[list[list[int]]] = field(default_factory=list)
    fixed_points: list[list[int]] = field(default_factory=list)
    valid_lens: list[int] = field(default_factory=list)
    hit_eos: bool = False
    # The current block: its state, the accepted prefix (n once the block is over), its stored
    # states and how many of its tokens are valid (n unless it holds an EOS).
    state: list[int] = field(default_factory=list)
    done: int = 0
    block_states: list[list[int]] = field(default_factory=list)
    valid_len: int = 0

    def begin_block(self, n: int, eos: Collection[int], pad: int) -> None:
        """2. The draft, or a one-token block when the first token is EOS (over at once, no forward)."""
        if self.first in eos:
            self.state, self.done, self.valid_len = [self.first] + [pad] * (n - 1), n, 1
        else:
            pool = self.prompt + self.generated
            self.state = [self.first] + [pool[i] for i in self.rng.integers(0, len(pool), size=n - 1).tolist()]
            self.done, self.valid_len = 0, n
        self.block_states = [list(self.state)]  # a copy: later updates never touch a stored state

    def step(self, guesses: list[int], offset: int, eos: Collection[int]) -> None:
        """3-4. One Jacobi iteration from ``guesses`` (argmax at block offsets ``offset..n-1``)."""
        n = len(self.state)
        self.forwards += 1
        accepted = self.done + 1  # state[done] is exact: accepted prefix or the previous "+1" token
        while accepted < n and self.state[accepted] == guesses[accepted - 1 - offset]:
            accepted += 1
        eos_at = next((o for o in range(self.done, accepted) if self.state[o] in eos), None)
        if eos_at is not None:
            self.done, self.valid_len = n, eos_at + 1
        elif accepted == n:
            self.done, self.first = n, guesses[n - 1 - offset]
        else:
            self.state = self.state[:accepted] + guesses[accepted - 1 - offset : n - 1 - offset]  # Jacobi update
            self.block_states.append(list(self.state))
            self.done = accepted
            if self.state[accepted] in eos:  # the "+1" token is EOS: exact, no need to verify the tail
                self.done, self.valid_len = n, accepted + 1

    def end_block(self, eos: Collection[int], pad: int) -> None:
        """5. Record the block; EOS inside it masks the tail of every state."""
        n, v = len(self.state), self.valid_len
        states = [st[:v] + [pad] * (n - v) for st in self.block_states] if v < n else self.block_states
        self.hit_eos = any(t in eos for t in states[-1][:v])
        self.states.append(states)
        self.fixed_points.append(list(states[-1]))
        self.valid_lens.append(v)
        self.generated += states[-1][:v]

    def record(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt, "states": self.states, "fixed_points": self.fixed_points,
                "valid_lens": self.valid_lens, "hit_eos": self.hit_eos, "forwards": self.forwards}


@torch.no_grad()
def jacobi_trajectories(
    model,
    prompts: Sequence[Sequence[int]],
    settings: CollectSettings,
    rngs: Sequence[np.random.Generator],
) -> list[dict[str, Any]]:
    """Greedy Jacobi decoding of a batch of non-empty prompts block by block, recording every state
    (module docstring). The prompts are left-padded and decoded in lockstep, one block at a time:
    each forward covers block offsets ``d..n-1`` of every row, d the shortest accepted prefix among
    the rows whose block is not over (the cache keeps offsets below d, accepted in every row); a row
    whose block is over (converged, or ended by EOS) rides along unchanged until every row's is, and
    a row that hit EOS or the cap leaves the batch (and the cache) before the next block. A row's
    ``forwards`` counts the forwards it iterated in, so they (and, up to kernel rounding, its states)
    are those of decoding it alone; at batch 1 this is the one-prompt loop of the module docstring.

    Returns per prompt ``prompt_ids``, ``states``, ``fixed_points``, ``valid_lens``, ``hit_eos``,
    ``forwards``.
    """
    n, eos, pad = settings.block_size, set(settings.eos_token_ids), settings.pad_token_id
    device = next(model.parameters()).device
    rows = [_Trajectory([int(t) for t in p], rng) for p, rng in zip(prompts, rngs, strict=True)]
    ids, mask = left_pad([r.prompt for r in rows], pad_id=pad, device=device)  # [b, s]
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, s]: padding never shifts a row's positions
    first = _forward(model, ids, positions, mask, cache, keep=1)[:, -1].argmax(-1).tolist()  # 1. prefill
    for row, token in zip(rows, first):
        row.first, row.forwards = token, 1
    live = list(range(len(rows)))  # the batch's rows, in cache order
    while live:
        batch = [rows[i] for i in live]
        for row in batch:
            row.begin_block(n, eos, pad)
        prefix = cache.get_seq_length()  # everything before this block
        block_mask = torch.cat([mask, mask.new_ones(len(batch), n)], dim=1)  # [b, prefix + n]
        starts = torch.tensor([[len(r.prompt) + len(r.generated)] for r in batch], device=device)  # [b, 1]
        while (d := min(r.done for r in batch)) < n:
            state = torch.tensor([r.state[d:] for r in batch], device=device)  # [b, n - d]
            offsets = torch.arange(d, n, device=device)  # [n - d]
            guesses = _forward(model, state, starts + offsets, block_mask, cache).argmax(-1).tolist()  # [b][n - d]
            for row, g in zip(batch, guesses):
                if row.done < n:
                    row.step(g, d, eos)
            crop_cache(cache, prefix + min(r.done for r in batch))
        for row in batch:
            row.end_block(eos, pad)
        keep = [k for k, r in enumerate(batch) if not r.hit_eos and len(r.generated) < settings.max_new_tokens]
        if len(keep) < len(batch) and keep:
            cache.batch_select_indices(torch.tensor(keep, device=device))
        live, mask = [live[k] for k in keep], block_mask[keep]
    return [r.record() for r in rows]


@torch.no_grad()
def check_ar_greedy(model, prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]], atol: float,
                    names: Sequence[str]) -> list[int]:
    """One uncached causal forward over every row's ``prompt + generated`` (left-padded, explicit
    positions); every generated token must be the argmax at the position before it. Returns each
    row's number of near-ties (mismatches within ``atol``); a mismatch beyond it is an error naming
    the row (``names``) and the position."""
    device = next(model.parameters()).device
    ids, mask = left_pad([list(p) + list(g)[:-1] for p, g in zip(prompts, generated, strict=True)], pad_id=0,
                         device=device)  # [b, s]
    keep = max(len(g) for g in generated)  # left padding: every row's generated tokens end the row
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                   use_cache=False, logits_to_keep=keep).logits.float()  # [b, keep, V]
    near_ties = []
    for row, (prompt, tokens, name) in enumerate(zip(prompts, generated, names, strict=True)):
        tail = logits[row, keep - len(tokens):]  # [g, V]: row i predicts tokens[i]
        chosen = torch.tensor(list(tokens), device=device)  # [g]
        best = tail.argmax(-1)  # [g]
        gap = tail.max(-1).values - tail.gather(-1, chosen[:, None]).squeeze(-1)  # [g]
        mismatch = (best != chosen).nonzero().flatten().tolist()
        for i in mismatch:
            if gap[i] > atol:
                raise TrajectoryError(
                    f"{name}: generated token {i} (position {len(prompt) + i}) is {int(chosen[i])} from Jacobi "
                    f"decoding but AR greedy gives {int(best[i])} (logit gap {float(gap[i]):.4g} > "
                    f"greedy_atol={atol}); the converged blocks are not the AR greedy output")
        near_ties.append(len(mismatch))
    return near_ties


def _resolve_atol(model, atol: float | None) -> float:
    if atol is not None:
        return atol
    return 0.0 if next(model.parameters()).dtype == torch.float32 else 0.5


def collect_batch(model, indices: Sequence[int], prompts: Sequence[Sequence[int]],
                  settings: CollectSettings) -> list[dict[str, Any]]:
    """Trajectories of prompts ``indices`` decoded together (:func:`jacobi_trajectories`), each with
    its AR-greedy check; storage rows (``FEATURES``). A prompt's draft generator is seeded by
    (seed, index), so its row does not depend on the batch it was in."""
    empty = next((i for i, p in zip(indices, prompts, strict=True) if not p), None)
    if empty is not None:
        raise TrajectoryError(f"sample {empty}: Jacobi collection needs at least one prompt token "
                              f"(got an empty prompt)")
    rngs = [np.random.default_rng([settings.seed, i]) for i in indices]
    rows = jacobi_trajectories(model, prompts, settings, rngs)
    generated = [[t for fp, v in zip(r["fixed_points"], r["valid_lens"]) for t in fp[:v]] for r in rows]
    near_ties = check_ar_greedy(model, [r["prompt_ids"] for r in rows], generated,
                                _resolve_atol(model, settings.greedy_atol), [f"sample {i}" for i in indices])
    return [{"index": i, **r, "near_ties": k} for i, r, k in zip(indices, rows, near_ties, strict=True)]


def collect_one(model, index: int, prompt_ids: Sequence[int], settings: CollectSettings) -> dict[str, Any]:
    """Trajectory of prompt ``index`` alone (:func:`collect_batch` of one)."""
    return collect_batch(model, [index], [prompt_ids], settings)[0]


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def num_shards(num_prompts: int, shard_size: int) -> int:
    return -(-num_prompts // shard_size)


def shard_path(directory: Path, shard: int, total: int) -> Path:
    return directory / f"shard-{shard:05d}-of-{total:05d}.parquet"


def _prompts_hash(prompts: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([int(t) for t in p]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` or check that the existing one records the same collection."""
    path = directory / META_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        for key, value in meta.items():
            if old.get(key) != value:
                raise TrajectoryError(
                    f"{path}: existing trajectories were collected with {key}={old.get(key)!r}, this run asks for "
                    f"{key}={value!r}; use another directory (or delete this one) to collect anew"
                )
        return
    tmp = directory / f".{META_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)  # every rank writes identical content: the race is harmless


def collect_trajectories(
    model,
    prompts: Sequence[Sequence[int]],
    out_dir: str | Path,
    settings: CollectSettings,
    rank: int = 0,
    world_size: int = 1,
) -> list[Path]:
    """Collect this rank's shards (r, r + W, ...) into ``out_dir``, skipping finished ones.

    The model is put in eval mode for the collection and restored afterwards. Returns the shard
    paths this rank owns (written now or earlier).
    """
    settings.check()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of size {world_size}")
    if not prompts:
        raise TrajectoryError("no prompts to collect trajectories from")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    total = num_shards(len(prompts), settings.shard_size)
    meta = {  # what determines the stored rows (greedy_atol only decides whether to raise)
        "format": FORMAT_VERSION, "block_size": settings.block_size, "max_new_tokens": settings.max_new_tokens,
        "eos_token_ids": list(settings.eos_token_ids), "pad_token_id": settings.pad_token_id, "seed": settings.seed,
        "shard_size": settings.shard_size, "num_prompts": len(prompts), "num_shards": total,
        "prompts_sha256": _prompts_hash(prompts),
    }
    _write_meta(directory, meta)

    was_training = model.training
    model.eval()
    owned = []
    try:
        for shard in range(rank, total, world_size):
            path = shard_path(directory, shard, total)
            owned.append(path)
            if path.is_file():
                continue
            lo, hi = shard * settings.shard_size, min((shard + 1) * settings.shard_size, len(prompts))
            rows, start = [], time.perf_counter()
            with cached_step_attention(), without_flex_attention(model):
                for first in range(lo, hi, settings.batch_size):
                    batch = range(first, min(first + settings.batch_size, hi))
                    rows += collect_batch(model, list(batch), [prompts[i] for i in batch], settings)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            datasets.Dataset.from_list(rows, features=FEATURES).to_parquet(str(tmp))
            os.replace(tmp, path)
            log.info("trajectories: shard %d of %d (%d prompts) in %.1f s", shard + 1, total, hi - lo,
                     time.perf_counter() - start)
    finally:
        model.train(was_training)
    return owned


def load_trajectories(directory: str | Path) -> datasets.Dataset:
    """All shards of a finished collection as one dataset, rows in prompt order."""
    directory = Path(directory)
    meta = read_meta(directory)
    files = [shard_path(directory, k, meta["num_shards"]) for k in range(meta["num_shards"])]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise TrajectoryError(
            f"{directory}: {len(missing)} of {len(files)} shards are missing (first: {missing[0]}); "
            f"the collection is unfinished: run it again to resume"
        )
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                               cache_dir=str(directory / ".hf_cache"), features=FEATURES)
    if ds["index"] != list(range(meta["num_prompts"])):
        raise TrajectoryError(f"{directory}: shard rows do not cover prompts 0..{meta['num_prompts'] - 1} in order")
    return ds


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise TrajectoryError(f"{directory}: no {META_FILE}; not a trajectory directory (collect first)")
    return json.loads(path.read_text())
