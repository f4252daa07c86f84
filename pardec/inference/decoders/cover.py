"""COVER: revocable MDM decoding with single-forward verification through KV override.

Reference: COVER, Stop the Flip-Flop: Context-Preserving Verification for Fast Revocable Diffusion
Decoding, arXiv:2602.06161 (§3 protocol, §5.1 KV override + App. B correction, §5.2 drafting and
Keep/Replace/ReMask, §5.3 seed scoring and adaptive revision rate). Its code is not public: this
follows the paper; the choices the paper leaves open are marked **(choice)** below and listed in
docs/methods/cover.md#deviations-and-choices.

Same fixed length, semi-AR blocks, named errors, EOS stop and counting as the other MDM decoders
(:mod:`pardec.inference.decoders.mdm_common`): ``prompt + L x <|mask|>``, blocks decoded left to right,
decoding stops once every position up to the first EOS is decoded; every forward is a decoding
forward (no cache: each step is one full forward with the explicit bidirectional/block mask). With
``cuda_graphs`` the forwards read static buffers and, on a GPU, replay one captured graph per sequence
length (:mod:`pardec.inference.decoders.override_forward`; docs/methods/cover.md#cuda-graphs).

**One step** (current block ``[s, e)``; with the logit shift, position j is read from output j-1):

1. *Input*: the current state with last step's seeds ``S`` re-masked. ``override=true``: every
   layer's attention is :func:`pardec.models.kv_override.kv_override_attention` (installed by ``prepare``):
   every query sees the seeds' K/V cached from the previous forward, except each seed's own
   verifying query (row i - shift, shift from the checkpoint's ``logit_shift``), which sees the
   mask-derived K/V (its score and value at column i substituted within the same pass; not the
   paper's closed-form rescale, which fails when attention is peaked: docs/methods/cover.md#kv-override).
   ``override=false`` (the paper's "w/o kv" ablation): the same masked input with no cache
   injection, so every query sees mask K/V at the seeds. The cache is literally the previous
   forward's K/V (paper §5.1): a seed drafted in the previous step was a mask in that forward, so
   its cached K/V are mask-derived.
   *Under the logit shift the drafting view is not exactly stable beyond the first layer:* seed
   i's verifying row is i - 1, a non-seed position, and its leave-one-out hidden state produces
   its own (not overridden) K/V, which every query reads in the next layer. Without a shift (the
   paper's LLaDA) the verifying row is the seed itself, whose column is overridden, so no such leak
   exists. Removing it would need the column i - 1 overridden too (a second corrected column per
   verifying row); not done here (tests: the identity holds for a one-layer model). Likewise the
   row that predicts position i + 1 is the seed's own row, whose input is ``<|mask|>``: it sees the
   seed's cached K/V through attention, but its residual stream starts from the mask embedding.
   ``seed_input=token`` **(beyond the paper, for the logit shift)** mirrors the override: the
   seeds keep their tokens in the input, so every row (the seed's own, which predicts i + 1,
   included) is the plain forward's, except each seed's verifying row i - 1, which sees column i
   through the same substitution with the K/V that column had in the last forward that fed
   position i a mask (its drafting forward, or the one after a ReMask), kept per layer and position.
   What a non-verifying query sees at a seed is then this forward's token K/V instead of the
   previous forward's (which for a seed drafted one step earlier are mask-derived). Without a
   shift the verifying row would be the seed's own row, whose input is its token: the mirror needs
   the shift (which ``mdm_info`` guarantees).
2. *Draft*: among the block's masked positions (not the seeds), those with confidence (softmax
   probability of the argmax) > ``draft_threshold``, at most ``draft_budget`` (the most confident),
   and the most confident one always **(choice: "always top-1", so every step
   progresses; docs/methods/cover.md#drafting)**.
3. *Verify* each seed i with its prediction (ỹ, c̃): Keep if ỹ equals the current token; Replace
   (in place) if ỹ differs and c̃ > ``draft_threshold``; ReMask otherwise. **ReMask cap (choice,
   docs/methods/cover.md#keep-replace-remask):** at most ``|drafted| - 1`` ReMasks per step, so the
   number of decoded positions grows by at least one per step (a block of size k finishes in at
   most k steps); when the cap binds, the seeds whose current token has the lowest probability are
   re-masked and the others kept (counted in ``stats["capped_remasks"]``).
4. *Seeds for the next step* (only while the block still has masked positions), from the block's
   decoded positions **(choice: the pool is the current block, not the whole answer)**:
   ``score(j) = u(j) (1 + d_in(j)) / (1 + d_out(j))`` with ``u = -log p_j(y_j)`` from this forward,
   and from the last layer's corrected head-averaged attention ``A`` (computed explicitly by the
   override function; SDPA returns none): ``d_in(j)`` = attention mass to column j from the rows
   that predict the still-masked positions (all of them, paper's M_t; with the shift that is row
   q - 1 for masked q **(choice)**), ``d_out(j)`` = mass from row j (whose hidden state produces j's
   cached K/V **(choice)**) to the positions drafted this step. Count ``ceil(sqrt(n_t * pi_t))``
   over the n_t decoded positions of the block, pi_t = fraction scoring above their mean; the
   top-scoring ones are taken, never last step's seeds nor positions that used their revision
   budget. **Budget (choice):** ``max_revisions`` (the paper's M_remask) counts ReMasks *and*
   Replaces of a position, so neither can oscillate without end. A new block starts with no seeds.

**Statistics** (``DecodeResult.stats``, aggregated by ``summarize``): ``steps`` (= forwards),
``revisions`` (ReMask + Replace, as the paper counts COVER's), ``remasks``, ``replaces``,
``flip_flops`` (a re-masked position later decoded again to the token it had when re-masked),
``effective_revisions`` (revisions whose position ends with a token different from the one the
revision removed; **(choice)** the paper counts every Replace as effective, here a Replace undone
later is not; a position left masked by the EOS stop counts as not effective), ``capped_remasks``
``tokens_per_step`` (committed / steps), ``seeds`` (seeds chosen) and ``fresh_seeds`` (those drafted
in the same step; with ``seed_input=mask`` the cache injected for them is the mask-derived K/V of that
step's forward, so the override changes nothing for them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from pardec.common.attention import attention_implementation
from pardec.common.config_fields import Choice, ranged
from pardec.inference.decoders.base import DecodeResult, LoopTimer, model_device
from pardec.inference.decoders.decode_steps import StepsPool
from pardec.inference.decoders.mdm_common import (
    REMASK,
    REPLACE,
    BlockRun,
    MDMDecoder,
    MDMDecoderConfig,
    RevisionLog,
    mdm_info,
)
from pardec.inference.decoders.override_forward import OverrideForwards
from pardec.models.bidirectional import non_causal
from pardec.models.kv_override import KV_OVERRIDE, OTHERS, VERIFIERS, register

KEEP = "keep"


class SeedInput(Choice):
    """What a seed is fed with under the override (see ``CoverConfig.seed_input``)."""

    mask = "mask"
    token = "token"



@dataclass
class CoverConfig(MDMDecoderConfig):
    name: str = "cover"
    # tau_draft: drafting threshold (strict >) and the Replace threshold (paper: 0.7 | 0.8 | 0.9).
    draft_threshold: float = ranged(0.8, ge=0, lt=1)
    # B: at most this many positions drafted per step (paper: 15).
    draft_budget: int = ranged(15, ge=1)
    # M_remask: revisions (ReMask + Replace) a position may receive; at the budget it is no seed (paper: ~5).
    max_revisions: int = ranged(5, ge=0)
    # false: the "w/o kv" ablation (seeds re-masked, no K/V injection, no correction).
    override: bool = True
    # With override: "token" (the mirror, beyond the paper; chosen on val: see docs/results/cover.md) feeds the
    # seeds' tokens and shows only each seed's verifying row mask-derived K/V (from the last forward
    # that fed the seed a mask); "mask" (the paper) feeds the seeds masked and shows every other
    # query their previous-forward K/V.
    seed_input: SeedInput = SeedInput.token


# -- the step rules, on one block's tensors (tested on hand-built tables) ---------------------------


def draft(conf: torch.Tensor, masked: torch.Tensor, threshold: float, budget: int) -> list[int]:
    """Offsets to draft: masked with ``conf > threshold``, the ``budget`` most confident, and the
    most confident masked one always. ``conf [B]``, ``masked [B]`` bool."""
    if not bool(masked.any()):
        return []
    c = conf.float().masked_fill(~masked, float("-inf"))  # [B]
    over = (c > threshold).nonzero().flatten()  # [k]
    if over.numel() > budget:
        over = over[torch.sort(c[over], descending=True, stable=True).indices[:budget]]
    chosen = set(over.tolist()) | {int(c.argmax())}
    return sorted(chosen)


def verify(current: Sequence[int], probs: torch.Tensor, threshold: float) -> list[tuple[str, int]]:
    """Keep / Replace / ReMask for each seed: ``current[k]`` its token, ``probs [S, V]`` its
    verification distribution. Returns ``(decision, token after the decision)`` (-1 for ReMask)."""
    out = []
    for k, token in enumerate(current):
        c, y = probs[k].max(-1)
        if int(y) == token:
            out.append((KEEP, token))
        elif float(c) > threshold:
            out.append((REPLACE, int(y)))
        else:
            out.append((REMASK, -1))
    return out


def cap_remasks(decisions: list[tuple[str, int]], current: Sequence[int], current_prob: Sequence[float],
                n_drafted: int) -> tuple[list[tuple[str, int]], int]:
    """At most ``n_drafted - 1`` ReMasks (net progress >= 1): the seeds whose current token has the
    lowest probability ``current_prob`` are re-masked, the rest kept. Returns (decisions, #capped)."""
    remasks = sorted((k for k, (d, _) in enumerate(decisions) if d == REMASK), key=lambda k: current_prob[k])
    allowed = max(n_drafted - 1, 0)
    out = list(decisions)
    for k in remasks[allowed:]:
        out[k] = (KEEP, current[k])
    return out, max(len(remasks) - allowed, 0)


def seed_signals(attention: torch.Tensor, masked: torch.Tensor, drafted: torch.Tensor, shift: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_in [n], d_out [n])`` from ``attention [n, n]`` (rows = queries, columns = keys of the
    same positions), ``masked [n]`` the still-masked positions, ``drafted [n]`` this step's drafts.
    d_in(j) = sum over masked q of A[q - shift, j]; d_out(j) = sum over drafted i of A[j, i]."""
    rows = masked.nonzero().flatten() - shift  # [m]
    rows = rows[rows >= 0]
    d_in = attention[rows].sum(0)  # [n]
    d_out = attention[:, drafted].sum(-1)  # [n]
    return d_in, d_out


def seed_scores(u: torch.Tensor, d_in: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    return u * (1 + d_in) / (1 + d_out)


def seed_count(pool_scores: torch.Tensor) -> int:
    """``ceil(sqrt(n * pi))`` with pi the fraction of the n pool scores above their mean, i.e. the
    ceiling of the square root of the number m of scores above the mean."""
    if pool_scores.numel() == 0:
        return 0
    m = int((pool_scores > pool_scores.mean()).sum())
    root = math.isqrt(m)
    return root + (root * root < m)


def select_seeds(scores: torch.Tensor, pool: torch.Tensor, eligible: torch.Tensor) -> list[int]:
    """Indices of the next seeds: the count from the whole pool's scores, the top-scoring among
    ``pool & eligible`` (``scores``, ``pool``, ``eligible`` [n]; ties go to the lower index)."""
    candidates = pool & eligible
    k = min(seed_count(scores[pool]), int(candidates.sum()))
    if k == 0:
        return []
    ranked = torch.sort(scores.float().masked_fill(~candidates, float("-inf")), descending=True, stable=True).indices
    return sorted(ranked[:k].tolist())


def remember_mask_kv(memory, recorded, fed_masks: torch.Tensor):
    """Per layer, ``recorded`` K/V [1, h_kv, n, d] at the positions fed a mask (``fed_masks [n]``),
    ``memory``'s elsewhere (all of ``recorded`` when there is no memory yet)."""
    if memory is None:  # copies: a captured forward rewrites its recorded K/V at its next replay
        return {layer: (k.clone(), v.clone()) for layer, (k, v) in recorded.items()}
    where = fed_masks[None, None, :, None]  # [1, 1, n, 1]
    return {layer: (torch.where(where, k, memory[layer][0]), torch.where(where, v, memory[layer][1]))
            for layer, (k, v) in recorded.items()}


class CoverDecoder(MDMDecoder):
    name = "cover"
    no_freecache_reason = "COVER runs one full forward per step (its K/V override replaces the previous step's K/V)"

    def __init__(self, cfg: CoverConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        # Every COVER forward is a full override forward, eager or static (cuda_graphs); the block run's decode
        # steps are never used, so they stay eager (no static cache allocated, no width captured).
        self.steps = StepsPool(cuda_graphs=False)
        self.forwards = OverrideForwards(cfg.cuda_graphs)

    @contextlib.contextmanager
    def prepare(self, model) -> Iterator[None]:
        """Check the checkpoint, install the KV-override attention in every layer and switch the
        modules to non-causal; the previous attention implementation is restored on exit."""
        mdm_info(model, self.tokenizer)
        register()
        with attention_implementation(model, KV_OVERRIDE), non_causal(model):
            yield

    @property
    def token_input(self) -> bool:
        """Seeds keep their tokens in the input (``seed_input=token`` with the override on)."""
        return self.cfg.override and self.cfg.seed_input == "token"

    # -- one forward -------------------------------------------------------------------------------

    def _forward(self, run: BlockRun, forward, seeds: list[int], cached):
        """The full sequence with ``seeds`` masked (or, ``seed_input=token``, holding their tokens);
        logits [n, V], the step (recorded K/V, attention) and which positions were fed a mask [n]."""
        fed = run.x.clone()
        seed_mask = torch.zeros_like(run.x, dtype=torch.bool)  # [n]
        if seeds:
            if not self.token_input:
                fed[seeds] = run.info.mask_id
            seed_mask[seeds] = True
        use_override = self.cfg.override and bool(seeds) and cached is not None
        logits, step = forward(fed, seed_mask if use_override else None, cached if use_override else None)
        if step.attention is None:
            raise RuntimeError("the KV-override attention did not run (decode inside decoder.prepare(model))")
        return run.counted(logits), step, fed == run.info.mask_id

    # -- the loop ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        if not prompt:
            raise ValueError("MDM decoding needs at least one prompt token (got an empty prompt)")
        info = mdm_info(model, self.tokenizer)
        block = self.block_size(info)
        with contextlib.ExitStack() as stack:
            if model.config._attn_implementation != KV_OVERRIDE:
                stack.enter_context(self.prepare(model))
            return self._decode(model, info, block, prompt, set(eos_token_ids))

    def _decode(self, model, info, block: int, prompt: list[int], eos: set[int]) -> DecodeResult:
        cfg = self.cfg
        device = model_device(model)
        run = BlockRun(self, model, info, prompt, cfg.max_new_tokens, block, device)
        shift = 1  # mdm_info guarantees logit_shift = true: output j-1 predicts position j
        last_layer = model.config.get_text_config().num_hidden_layers - 1
        log = RevisionLog()
        capped = n_seeds = fresh_seeds = 0
        mask_id = info.mask_id
        token_input = self.token_input
        mask_kv = None  # seed_input=token: per layer, each position's K/V from the last forward that fed it a mask
        # Built (with cuda_graphs on a GPU: captured) before the timed loop.
        forward = self.forwards.get(model, run.full_mask, shift, last_layer, VERIFIERS if token_input else OTHERS)

        with LoopTimer(device) as timer:
            for b in range(run.n_blocks):
                s, e = run.span(b)
                seeds: list[int] = []  # absolute positions verified by the next forward
                cached = None
                while run.masked_in_block(b).any():
                    logits, step, fed_masks = self._forward(run, forward, seeds, cached)
                    if token_input:
                        mask_kv = remember_mask_kv(mask_kv, step.recorded, fed_masks)
                    probs = torch.softmax(logits[s - shift : e - shift].float(), dim=-1)  # [B, V]
                    masked = run.masked_in_block(b)  # [B] (seeds hold their tokens in x)
                    conf, tokens = probs.max(-1)  # [B], [B]
                    drafted = draft(conf, masked, cfg.draft_threshold, cfg.draft_budget)

                    offsets = [p - s for p in seeds]
                    current = [int(run.x[p]) for p in seeds]
                    decisions = verify(current, probs[offsets], cfg.draft_threshold)
                    current_prob = [float(probs[o, t]) for o, t in zip(offsets, current)]
                    decisions, n_capped = cap_remasks(decisions, current, current_prob, len(drafted))
                    capped += n_capped

                    for o in drafted:
                        run.x[s + o] = tokens[o]
                        log.unmask(s + o, int(tokens[o]))
                    for pos, old, (decision, token) in zip(seeds, current, decisions):
                        if decision == REPLACE:
                            run.x[pos] = token
                            log.replace(pos, old, token)
                        elif decision == REMASK:
                            run.x[pos] = mask_id
                            log.remask(pos, old)

                    if run.done(eos):
                        break
                    still_masked = run.masked_in_block(b)  # [B]
                    if not still_masked.any():
                        break
                    # Next seeds, from the block's decoded positions.
                    n = run.x.numel()
                    drafted_mask = torch.zeros(n, dtype=torch.bool, device=device)
                    drafted_mask[[s + o for o in drafted]] = True
                    d_in, d_out = seed_signals(step.attention[0].float(), run.x == mask_id, drafted_mask, shift)
                    current_tokens = run.x[s:e]  # [B]
                    p_current = probs.gather(-1, current_tokens.clamp(max=probs.shape[-1] - 1)[:, None])[:, 0]  # [B]
                    u = -torch.log(p_current.clamp_min(1e-12))  # [B]
                    scores = seed_scores(u, d_in[s:e], d_out[s:e])  # [B]
                    pool = ~still_masked  # [B]
                    eligible = torch.ones_like(pool)
                    for o in offsets:
                        eligible[o] = False  # never last step's seeds again
                    for o in range(block):
                        if log.per_position.get(s + o, 0) >= cfg.max_revisions:
                            eligible[o] = False
                    seeds = [s + o for o in select_seeds(scores, pool, eligible)]
                    n_seeds += len(seeds)
                    fresh_seeds += sum(1 for p in seeds if p - s in drafted)  # seed_input=mask: cache mask-derived
                    cached = (mask_kv if token_input else step.recorded) if cfg.override else None
                if run.done(eos):
                    break

        return self.finish_run(run, eos, timer.elapsed, log, capped_remasks=capped, seeds=n_seeds,
                               fresh_seeds=fresh_seeds, override=cfg.override)
