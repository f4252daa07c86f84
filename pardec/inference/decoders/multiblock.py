"""Multi-block Jacobi decoding with rejection recycling (the paper's "MR" decoding), greedy, lossless.

References: Jacobi Forcing, "Fast and Accurate Causal Parallel Decoding using Jacobi Forcing",
arXiv:2512.14681, §3.2 and Appendix A, Algorithm 1; docs/methods/jacobi_forcing.md#multi-block-decoding.

Blocks and drafts. Output positions are cut into blocks of ``n`` (``block_size``) as in
``pardec.inference.decoders.jacobi``. Up to ``K`` (``num_blocks``) consecutive blocks are in flight. The
first one is the *real-active* block (RA): the one at the committed frontier, the only place where
tokens are committed. The others are *pseudo-active*: they are iterated like Jacobi blocks but
conditioned on the drafts of the blocks before them, and their converged tokens are only
*pseudo-accepted* (frozen, no longer updated) until they are verified. Every in-flight position
holds one draft token; together they form the *chain* ``[P, E)`` (``P`` = next position to
commit, ``E`` = end of the last block). The anchor is the last committed token (position
``P - 1``); the KV cache holds exactly the prompt and the committed tokens except the anchor.

One forward per iteration, over (buffer order)::

    [anchor | chain drafts for P .. E-2 | candidate 1 | ... | candidate m]       # [1, 1 + (E-1-P) + m*L]

``E - 1`` (the last position of the last block) is never an input: nothing in flight depends on
it, exactly like ``y_n`` in Jacobi decoding. Candidates are recycled n-grams (below), each an
alternative draft for the RA's input positions ``P .. P+L-1`` (``L`` = RA positions in the
chain's input). Copies of a position share its position id (docs/methods/conventions.md#position-ids).

Attention mask (a predicate over per-token ``branch`` and position ids, materialised as a 4-D
float additive mask: 0 allowed, ``finfo.min`` elsewhere; see :func:`multiblock_mask`):

- every query sees the whole KV cache (committed tokens) and the anchor;
- the chain is plain causal: an RA draft token sees the RA drafts before it, a pseudo-active
  block sees the RA drafts, all earlier pseudo-active blocks and its own earlier drafts (this is
  the paper's "pseudo-active blocks are drafted conditioned on the real-active block's current
  draft", Algorithm 1 line 4: blocks are concatenated in position order);
- a candidate token sees its own earlier tokens only (plus cache and anchor): it never sees the
  chain's drafts nor another candidate, and nothing sees a candidate. It is the reference's
  "candidates appended along the batch dimension, sharing the KV cache", packed in one row
  (the reference also repeats the pseudo-active blocks behind every candidate row; here they
  follow the chain's RA draft only, so each extra candidate costs L tokens, not K * n).

Example: committed c0..c2 in the cache, anchor a3, n = 2, K = 2: RA = {4, 5}, pseudo = {6, 7}
(7 not an input), one candidate e4 e5::

        q\\kv   c0 c1 c2 | a3 | r4 r5 p6 | e4 e5      predicts
        a3      x  x  x  | x  | .  .  .  | .  .      g4 (exact)
        r4      x  x  x  | x  | x  .  .  | .  .      g5
        r5      x  x  x  | x  | x  x  .  | .  .      g6
        p6      x  x  x  | x  | x  x  x  | .  .      g7
        e4      x  x  x  | x  | .  .  .  | x  .      h5
        e5      x  x  x  | x  | .  .  .  | x  x      h6   (h4 = g4)

Per iteration:

1. If no block is in flight, open the RA block ``[P, min(P + n, end))`` from a fresh draft
   (``draft_init`` as in Jacobi decoding).
2. Build up to ``verification_size`` candidates from the n-gram pool for the current anchor.
3. One forward (above); ``g`` = argmax over the anchor and the chain: the greedy token for each
   position of ``[P, E)``; ``h_j`` likewise for candidate j over ``[P, P + L]``.
4. Verify (greedy, lossless): a branch commits its longest prefix that agrees with its own
   predictions plus the next prediction (exact, since it is conditioned on committed tokens
   only). The chain is verified as one sequence: once every RA token agrees, the next block's
   drafts were conditioned on exactly the committed tokens *in this very forward*, so
   verification continues into them: the block is promoted and its pseudo-active drafts are
   verified with an exact context without spending a forward. The branch that commits most wins
   (ties to the chain). Stop after the first EOS or at ``max_new_tokens``.
5. Crop the KV cache to the committed tokens: the anchor and the accepted inputs of the winning
   branch stay (a candidate's entries are moved next to the anchor: they were computed with
   exactly the committed context), everything else is dropped.
6. Recycle: push the chain's rejected suffix (its drafts from the first disagreement on) into the
   n-gram pool (FIFO, ``ngram_pool_size`` sequences).
7. Update the drafts: RA positions (of the forward) take the winning branch's predictions (the
   Jacobi update); a pseudo-active block keeps its pseudo-accepted prefix, takes ``g`` elsewhere,
   and extends the prefix by its longest agreeing run plus one (Algorithm 1 line 7/11).
8. Retire the blocks that are fully committed; the first remaining block becomes the RA
   (promotion) and keeps ALL its drafts (pseudo-accepted prefix and tail) as the RA draft, which
   the next forward verifies. The reference implementation returns after a promotion and
   discards the pseudo-active work; that is not copied.
9. Spawn: if fewer than K blocks are in flight and the newest block's progress (committed tokens
   for the RA, pseudo-accepted tokens for a pseudo-active block) is ``>= ceil(r * n)``
   (``spawn_ratio``), open the next block after it from a fresh draft (the reference clones the
   RA's draft padded with pad tokens instead). At most one spawn per iteration; a block is only
   spawned after a forward, so ``0 < r <= 1``.

Rejection recycling (the candidates): the pool keeps the last ``ngram_pool_size`` rejected
suffixes. For the anchor token ``a``, each pooled sequence (newest first) containing ``a`` with
at least one token after it yields the candidate "the tokens after the first ``a``", cut to
``L`` or completed with the chain's own RA drafts; duplicates and copies of the chain's drafts
are skipped; at most ``verification_size`` candidates per forward. Recycling is off when either
size is 0. With ``K = 1`` and recycling off this decoder is exactly ``jacobi`` (same forwards,
same tokens, same draft stream).

Counting: one forward per iteration (candidates included), each commits between 1 and ``K * n``
tokens, so ``ceil(committed / (K * n)) <= forwards <= committed``.

The forwards run through ``pardec.inference.decoders.decode_steps`` (a ``DynamicCache`` by default;
``cuda_graphs: true``: a static cache, each forward width captured once as a CUDA graph, batch 1;
the branches' shared positions go in as offsets and step 5 copies the kept keys down in place).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from pardec.common.config_fields import ranged
from pardec.common.metadata import AR, MASKED_AR
from pardec.inference.decoders.base import DecoderConfig, DecodeResult, LoopTimer, PerSampleDecoder, model_device
from pardec.inference.decoders.decode_steps import DynamicSteps, StaticSteps, StepsPool
from pardec.inference.decoders.jacobi import (
    DraftInit,
    converged_prefix,
    init_draft,
    resolve_block_size,
    truncate_at_eos,
)
from pardec.masks.core import MaskMod, additive_mask, require_dense_attention

ROOT = 0  # branch id of the anchor (seen by every branch)
CHAIN = 1  # branch id of the blocks' drafts; candidate j (0-based) is CHAIN + 1 + j



@dataclass
class MultiBlockDecoderConfig(DecoderConfig):
    name: str = "multiblock"
    block_size: Optional[int] = ranged(None, ge=1)  # n; null = the checkpoint's recorded jacobi_block_size
    num_blocks: int = ranged(2, ge=1)  # K: blocks in flight (1 real-active + up to K-1 pseudo-active)
    spawn_ratio: float = ranged(0.85, gt=0, le=1)  # r: spawn the next block once the newest one has >= ceil(r*n) tokens
    # Rejected sequences kept for recycling, and pool candidates verified per forward besides the chain.
    ngram_pool_size: int = ranged(4, ge=0, note="0 = recycling off")
    verification_size: int = ranged(4, ge=0, note="0 = recycling off")
    draft_init: DraftInit = DraftInit.context  # as in JacobiDecoderConfig
    # Each forward width as a CUDA graph over a static cache (as JacobiDecoderConfig.cuda_graphs).
    cuda_graphs: bool = False


# --------------------------------------------------------------------------- attention mask


def multiblock_mask(branch: torch.Tensor, position_ids: torch.Tensor, cache_len: int) -> MaskMod:
    """Mask predicate over ``[cache | new tokens]`` keys for the new-token queries.

    ``branch``, ``position_ids``: ``[1, q]`` for the new tokens (ROOT, CHAIN, candidates).
    ``kv_idx < cache_len`` is a committed token (always visible); a new key is visible when it is
    the anchor (ROOT) or on the query's branch at a position <= the query's.
    """

    def mask_mod(b, h, q_idx, kv_idx):  # q_idx is the query's key index: cache_len + its input index
        committed = kv_idx < cache_len
        new = (kv_idx - cache_len).clamp(min=0)
        q_new = q_idx - cache_len
        root = branch[b, new] == ROOT
        same_branch = (branch[b, new] == branch[b, q_new]) & (position_ids[b, new] <= position_ids[b, q_new])
        return committed | root | same_branch

    return mask_mod


@dataclass
class BranchPredictions:
    chain: list[int]  # greedy tokens for positions [P, P + len(chain)] (the chain inputs plus one)
    candidates: list[list[int]]  # per candidate: positions [P, P + L] (the first one shared with the chain)
    offsets: list[int]  # buffer index of each candidate's first token


def forward_branches(
    model,
    steps: DynamicSteps | StaticSteps,
    anchor: int,
    position: int,
    chain: Sequence[int],
    candidates: Sequence[Sequence[int]],
) -> BranchPredictions:
    """One forward over ``[anchor | chain | candidates...]`` (anchor at ``position - 1``, chain and
    candidates from ``position``) after the committed keys of ``steps`` (which end just before the
    anchor); appends every input's KV."""
    device = model_device(model)
    ids = [anchor, *chain]
    positions = [position - 1, *range(position, position + len(chain))]
    branch = [ROOT] + [CHAIN] * len(chain)
    offsets = []
    for j, cand in enumerate(candidates):
        offsets.append(len(ids))
        ids += cand
        positions += range(position, position + len(cand))
        branch += [CHAIN + 1 + j] * len(cand)
    positions_t = torch.tensor([positions], dtype=torch.long, device=device)  # [1, q]
    branch_t = torch.tensor([branch], dtype=torch.long, device=device)  # [1, q]
    q_len = len(ids)
    block = additive_mask(multiblock_mask(branch_t, positions_t, 0), 1, q_len, q_len,
                          model.dtype, device)  # [1, 1, q, q]
    logits = steps.forward(ids, block, [p - (position - 1) for p in positions])  # [q, V]
    pred = logits.argmax(dim=-1).tolist()  # [q]
    return BranchPredictions(
        chain=pred[: len(chain) + 1],
        candidates=[[pred[0]] + pred[o : o + len(c)] for o, c in zip(offsets, candidates)],
        offsets=offsets,
    )


# --------------------------------------------------------------------------- n-gram pool


class NgramPool:
    """FIFO pool of rejected draft sequences, recycled as candidate drafts (rejection recycling)."""

    def __init__(self, capacity: int):
        self.entries: deque[tuple[int, ...]] = deque(maxlen=capacity)

    def push(self, seq: Sequence[int]) -> None:
        if len(seq) >= 2:  # a candidate needs an anchor match and at least one token after it
            self.entries.append(tuple(seq))

    def candidates(self, anchor: int, main: Sequence[int], limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct drafts of ``len(main)`` tokens that follow the first ``anchor``
        of a pooled sequence (newest first), completed with ``main``'s tail when short."""
        out: list[list[int]] = []
        if not main:
            return out
        for seq in reversed(self.entries):
            hit = next((i for i in range(len(seq) - 1) if seq[i] == anchor), None)
            if hit is None:
                continue
            follow = list(seq[hit + 1 : hit + 1 + len(main)])
            cand = follow + list(main[len(follow) :])
            if cand != list(main) and cand not in out:
                out.append(cand)
                if len(out) == limit:
                    break
        return out


# --------------------------------------------------------------------------- block state


@dataclass
class Block:
    start: int
    end: int  # exclusive
    frozen_until: int  # pseudo-active: positions [start, frozen_until) are pseudo-accepted


@dataclass
class Commit:
    count: int  # tokens committed by the winning branch (>= 1)
    winner: int  # -1: the chain; j >= 0: candidate j
    preds: list[int]  # the winning branch's predictions from position P on
    chain_agreed: int  # the chain's agreeing prefix (its rejected suffix starts there)
    chain_count: int  # tokens the chain alone would have committed


def verify(draft: Sequence[int], preds: BranchPredictions, candidates: Sequence[Sequence[int]]) -> Commit:
    """Greedy verification of the chain (``draft``: one token per position of ``[P, E)``) and of
    every candidate; the branch committing most wins, ties to the chain.

    A branch commits its longest prefix agreeing with its predictions plus the prediction right
    after it (exact: conditioned on committed tokens only), within the positions it predicts.
    """
    agreed = converged_prefix(draft, preds.chain)
    chain_count = min(agreed + 1, len(draft))
    best = Commit(chain_count, -1, preds.chain, agreed, chain_count)
    for j, (cand, pred) in enumerate(zip(candidates, preds.candidates)):
        count = converged_prefix(cand, pred) + 1
        if count > best.count:
            best = Commit(count, j, pred, agreed, chain_count)
    return best


class BlockChain:
    """The blocks in flight and one draft token per position of ``[position, end)``."""

    def __init__(self, position: int, block_size: int, budget_end: int):
        self.position = position  # P: next position to commit (the anchor sits at P - 1)
        self.block_size = block_size
        self.budget_end = budget_end
        self.blocks: list[Block] = []
        self.draft: list[int] = []

    @property
    def end(self) -> int:
        return self.blocks[-1].end if self.blocks else self.position

    def inputs(self) -> list[int]:
        """The chain's input tokens: every draft but the last block's last one."""
        return self.draft[:-1]

    def real_active_inputs(self) -> int:
        """Number of chain inputs that lie in the real-active block (candidate length L)."""
        return min(self.blocks[0].end, self.end - 1) - self.position

    def open_block(self, tokens: list[int]) -> None:
        start = self.end
        self.blocks.append(Block(start, start + len(tokens), start))
        self.draft += tokens

    def next_block_length(self) -> int:
        return min(self.block_size, self.budget_end - self.end)

    def progress(self, block: Block) -> int:
        """Committed tokens of the RA block, pseudo-accepted tokens of a pseudo-active block."""
        if block is self.blocks[0]:
            return self.position - block.start
        return block.frozen_until - block.start

    def advance(self, commit: Commit, chain_preds: Sequence[int]) -> int:
        """Steps 7-8: new drafts and pseudo-accepted prefixes after ``commit``; retire finished
        blocks. Returns the pseudo-accepted tokens carried into a promoted RA (-1: no promotion)."""
        old, start = self.draft, self.position
        new_position = start + commit.count
        draft: list[int] = []
        for i, block in enumerate(self.blocks):
            lo, hi = max(block.start, new_position), block.end
            if i == 0:  # real-active during the forward: Jacobi update from the winning branch
                draft += commit.preds[lo - start : hi - start]
                continue
            frozen = block.frozen_until  # pseudo-active: freeze the agreeing run plus one
            run = converged_prefix(old[frozen - start : hi - start], chain_preds[frozen - start : hi - start])
            block.frozen_until = min(frozen + run + 1, hi)
            draft += [old[p - start] if p < frozen else chain_preds[p - start] for p in range(lo, hi)]
        self.position, self.draft = new_position, draft
        retired = sum(block.end <= new_position for block in self.blocks)
        self.blocks = self.blocks[retired:]
        if not retired or not self.blocks:
            return -1
        promoted = self.blocks[0]
        return max(promoted.frozen_until - max(promoted.start, new_position), 0)


# --------------------------------------------------------------------------- decoder


class MultiBlockDecoder(PerSampleDecoder):
    name = "multiblock"
    # The checkpoint kinds it decodes (pardec.common.metadata.CHECKPOINT_KINDS): every causal next-token LM.
    checkpoint_kinds = (AR, MASKED_AR)

    def __init__(self, cfg: MultiBlockDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.recycling = cfg.ngram_pool_size > 0 and cfg.verification_size > 0
        self.steps = StepsPool(cfg.cuda_graphs)

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        if not prompt:
            raise ValueError("multi-block decoding needs at least one prompt token (got an empty prompt)")
        require_dense_attention(model, "multi-block decoding")
        cfg = self.cfg
        device = model_device(model)
        rng = random.Random(seed)
        pool = NgramPool(cfg.ngram_pool_size)
        block_size = resolve_block_size(model, cfg.block_size)
        widest = 1 + (cfg.num_blocks + cfg.verification_size) * block_size  # anchor, blocks in flight, candidates
        steps = self.steps.get(model, len(prompt) + cfg.max_new_tokens + widest, widest)
        steps.reset(prompt[:-1])  # the last prompt token is the first anchor
        spawn_threshold = math.ceil(cfg.spawn_ratio * block_size)
        state = BlockChain(len(prompt), block_size, len(prompt) + cfg.max_new_tokens)
        anchor = prompt[-1]
        tokens: list[int] = []
        forwards = 0
        hit_eos = False
        stats = dict.fromkeys(
            ("blocks", "spawned", "promotions", "promoted_pseudo_accepted", "candidates_verified", "recycled_wins",
             "recycled_extra_tokens"),
            0,
        )

        with LoopTimer(device) as timer:
            while state.position < state.budget_end and not hit_eos:
                # 1. open the real-active block when nothing is in flight
                if not state.blocks:
                    length = state.next_block_length()
                    state.open_block(init_draft(cfg.draft_init, rng, list(prompt) + tokens, anchor, length))
                    stats["blocks"] += 1
                # 2. recycled candidates for the RA's input positions
                chain = state.inputs()
                ra_inputs = state.real_active_inputs()
                candidates = pool.candidates(anchor, chain[:ra_inputs], cfg.verification_size) if self.recycling else []
                # 3. one forward over anchor, chain and candidates
                cached = steps.length
                preds = forward_branches(model, steps, anchor, state.position, chain, candidates)
                forwards += 1
                stats["candidates_verified"] += len(candidates)
                # 4. greedy verification; commit the winner's accepted tokens
                commit = verify(state.draft, preds, candidates)
                if commit.winner >= 0:
                    stats["recycled_wins"] += 1
                    stats["recycled_extra_tokens"] += commit.count - commit.chain_count
                new, hit_eos = truncate_at_eos(commit.preds[: commit.count], eos_token_ids)
                tokens += new
                if hit_eos:
                    break
                # 5. KV: anchor + the winning branch's accepted inputs (moved next to the anchor)
                first = cached + 1 if commit.winner < 0 else cached + preds.offsets[commit.winner]
                steps.keep(cached + 1, first, commit.count - 1)
                # 6. recycle the chain's rejected suffix
                if self.recycling:
                    pool.push(state.draft[commit.chain_agreed :])
                # 7-8. Jacobi / pseudo-active updates, retire finished blocks, promote
                carried = state.advance(commit, preds.chain)
                anchor = commit.preds[commit.count - 1]
                if carried >= 0:
                    stats["promotions"] += 1
                    stats["promoted_pseudo_accepted"] += carried
                # 9. spawn the next pseudo-active block
                if (
                    state.blocks
                    and len(state.blocks) < cfg.num_blocks
                    and state.end < state.budget_end
                    and state.progress(state.blocks[-1]) >= spawn_threshold
                ):
                    previous = state.draft[-1]
                    length = state.next_block_length()
                    state.open_block(init_draft(cfg.draft_init, rng, list(prompt) + tokens, previous, length))
                    stats["blocks"] += 1
                    stats["spawned"] += 1

        return DecodeResult(
            tokens=tokens,
            forwards=forwards,
            committed=len(tokens),
            wall_time_s=timer.elapsed,
            hit_eos=hit_eos,
            stats=stats,
        )
