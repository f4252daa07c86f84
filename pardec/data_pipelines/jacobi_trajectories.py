"""Greedy Jacobi trajectory collection with a KV cache, sharded and resumable
(docs/methods/jacobi_forcing.md#trajectory-collection, paper §2.1).

Per prompt (batch 1, ``torch.no_grad``, the model in eval mode):

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

Check: the generated tokens must be AR greedy output. After each prompt, one uncached causal
forward over ``prompt + generated`` must give argmax == the next generated token at every
position. A mismatch is a :class:`TrajectoryError` naming the sample and position, unless the
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
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from transformers import DynamicCache

from pardec.common.kv_cache import cached_step_attention, crop_cache

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

    def check(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"Jacobi block size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if not self.eos_token_ids:
            raise ValueError("eos_token_ids is empty: collection needs at least one EOS id")


# ---------------------------------------------------------------------------------------------
# One prompt
# ---------------------------------------------------------------------------------------------


def _forward(model, ids: list[int], start: int, cache: DynamicCache, keep: int = 0) -> torch.Tensor:
    """Causal forward of ``ids`` at positions ``start..`` after the cached prefix. Returns the
    logits ``[len, V]``, or of the last ``keep`` positions only when ``keep > 0``."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)  # [1, l]
    positions = torch.arange(start, start + len(ids), device=device).unsqueeze(0)  # [1, l]
    out = model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[0]


@torch.no_grad()
def jacobi_trajectory(
    model,
    prompt_ids: Sequence[int],
    settings: CollectSettings,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Greedy Jacobi decoding of one prompt block by block, recording every state (module docstring).

    Returns ``prompt_ids``, ``states``, ``fixed_points``, ``valid_lens``, ``hit_eos``, ``forwards``.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("Jacobi collection needs at least one prompt token (got an empty prompt)")
    n, eos, pad = settings.block_size, set(settings.eos_token_ids), settings.pad_token_id
    cache = DynamicCache(config=model.config)
    first = int(_forward(model, prompt, 0, cache, keep=1)[-1].argmax())  # 1. prefill
    forwards = 1
    generated: list[int] = []
    record: dict[str, list] = {"states": [], "fixed_points": [], "valid_lens": []}
    hit_eos = False
    while len(generated) < settings.max_new_tokens and not hit_eos:
        start = len(prompt) + len(generated)  # == cache length: everything before this block
        if first in eos:
            states, valid_len = [[first] + [pad] * (n - 1)], 1
        else:
            pool = prompt + generated  # 2. draft
            state = [first] + [pool[i] for i in rng.integers(0, len(pool), size=n - 1).tolist()]
            states, valid_len, first, forwards = _iterate_block(model, cache, state, start, eos, forwards)
        if valid_len < n:  # 5. EOS inside the block: mask the tail in every state
            states = [s[:valid_len] + [pad] * (n - valid_len) for s in states]
        hit_eos = any(t in eos for t in states[-1][:valid_len])
        record["states"].append(states)
        record["fixed_points"].append(list(states[-1]))
        record["valid_lens"].append(valid_len)
        generated += states[-1][:valid_len]
    return {"prompt_ids": prompt, **record, "hit_eos": hit_eos, "forwards": forwards}


def _iterate_block(
    model, cache: DynamicCache, state: list[int], start: int, eos: Collection[int], forwards: int
) -> tuple[list[list[int]], int, int, int]:
    """3-4. Jacobi iterations of one block. Returns (states, valid_len, next block's first token,
    forwards). ``valid_len < n`` when EOS was accepted inside the block (next token then unused)."""
    n = len(state)
    states = [list(state)]  # a copy: later updates never touch a stored state
    done = 0  # leading block tokens whose KV is cached
    while True:
        guesses = _forward(model, state[done:], start + done, cache).argmax(-1).tolist()  # g_done..g_{n-1}
        forwards += 1
        accepted = done + 1  # state[done] is exact: accepted prefix or the previous "+1" token
        while accepted < n and state[accepted] == guesses[accepted - 1 - done]:
            accepted += 1
        crop_cache(cache, start + accepted)
        eos_at = next((o for o in range(done, accepted) if state[o] in eos), None)
        if eos_at is not None:
            return states, eos_at + 1, -1, forwards
        if accepted == n:
            return states, n, guesses[n - 1 - done], forwards
        state = state[:accepted] + guesses[accepted - 1 - done : n - 1 - done]  # Jacobi update
        states.append(list(state))
        done = accepted
        if state[accepted] in eos:  # the "+1" token is EOS: exact, no need to verify the tail
            return states, accepted + 1, -1, forwards


@torch.no_grad()
def check_ar_greedy(model, prompt_ids: Sequence[int], generated: Sequence[int], atol: float, where: str) -> int:
    """One uncached causal forward over ``prompt + generated``; every generated token must be the
    argmax at the position before it. Returns the number of near-ties (mismatches within ``atol``)."""
    device = next(model.parameters()).device
    seq = list(prompt_ids) + list(generated)
    tail = model(input_ids=torch.tensor([seq[:-1]], device=device), use_cache=False,
                 logits_to_keep=len(generated)).logits[0].float()  # [g, V]: row i predicts generated[i]
    chosen = torch.tensor(list(generated), device=device)
    best = tail.argmax(-1)  # [g]
    gap = tail.max(-1).values - tail.gather(-1, chosen[:, None]).squeeze(-1)  # [g]
    mismatch = (best != chosen).nonzero().flatten().tolist()
    for i in mismatch:
        if gap[i] > atol:
            raise TrajectoryError(
                f"{where}: generated token {i} (position {len(prompt_ids) + i}) is {int(chosen[i])} from Jacobi "
                f"decoding but AR greedy gives {int(best[i])} (logit gap {float(gap[i]):.4g} > greedy_atol={atol}); "
                f"the converged blocks are not the AR greedy output"
            )
    return len(mismatch)


def _resolve_atol(model, atol: float | None) -> float:
    if atol is not None:
        return atol
    return 0.0 if next(model.parameters()).dtype == torch.float32 else 0.5


def collect_one(model, index: int, prompt_ids: Sequence[int], settings: CollectSettings) -> dict[str, Any]:
    """Trajectory of prompt ``index`` plus its AR-greedy check; a storage row (``FEATURES``)."""
    rng = np.random.default_rng([settings.seed, index])
    try:
        row = jacobi_trajectory(model, prompt_ids, settings, rng)
    except ValueError as err:
        raise TrajectoryError(f"sample {index}: {err}") from None
    generated = [t for fp, v in zip(row["fixed_points"], row["valid_lens"]) for t in fp[:v]]
    near_ties = check_ar_greedy(model, row["prompt_ids"], generated, _resolve_atol(model, settings.greedy_atol),
                                where=f"sample {index}")
    return {"index": index, **row, "near_ties": near_ties}


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
            with cached_step_attention():  # no cuDNN attention: a cached step's shape is new at every step
                rows = [collect_one(model, i, prompts[i], settings) for i in range(lo, hi)]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            datasets.Dataset.from_list(rows, features=FEATURES).to_parquet(str(tmp))
            os.replace(tmp, path)
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
