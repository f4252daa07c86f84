"""ReFusion plan-and-infill decoding with KV reuse (docs/methods/refusion.md#decoding).

References: ReFusion, arXiv:2512.13586, §4.2 and Appendix A.2 (Eq. 4-7), §5.1 (semi-AR blocks).

The target of ``max_new_tokens`` = L positions after the prompt is cut into slots of k tokens (the
last one possibly short) and semi-AR blocks of b tokens (b a multiple of k). Each iteration:

1. **Plan** (one forward): after the KV cache of the committed context, feed any *pending* tokens
   (the last token of each slot completed in the previous step, whose K/V are not cached yet) and
   then the remaining masked slots in position order (``plan_scope=block``, the default and the
   official code: only the current block's; ``all``, the paper's wording: every remaining slot of
   the target; docs/methods/refusion.md#plan-scope). Attention is causal and the current block's
   slots are the first remaining ones, so the masks of later blocks cannot change their predictions:
   both scopes decode the same tokens (tested), ``block`` with shorter plan forwards. Each mask
   predicts its own token: the draft is its argmax (``mode=greedy``) or a sample (``mode=sample``,
   temperature / top-k / top-p). A slot's score is the probability of its draft's first token
   (Eq. 5). Among the current block's masked slots, those with score > ``plan_threshold`` are selected;
   if none, the single best. The masks' K/V are dropped; the pending tokens' K/V kept.
2. **Verify** (one forward): the selected drafts concatenated in position order, causal. Token j > 1
   of a slot has the probability of the draft under the query before it; token 1 keeps its plan
   probability (Eq. 6). The longest prefix with every probability > ``verify_threshold`` is found;
   if it covers >= 1 whole slot, those slots are accepted with the K/V of this forward (each saw the
   context and the accepted slots before it: the same tokens in the same order), and the step ends.
3. **Complete** (otherwise): every draft is truncated to l' >= 1, the longest prefix verified in
   every selected slot (the first token counts as verified, Eq. 7), the verify K/V are dropped, and
   the slots are completed autoregressively *in parallel*, one forward per round: round 0 feeds
   every slot's l' tokens, later rounds each unfinished slot's newest token, all in one row whose
   mask (``pardec.masks.refusion.refusion_decode_mask``) lets a slot see only the committed context and
   itself; its last token becomes pending. This single row is equivalent to completing the slots as
   batched rows that share the KV cache, without copying the cache per slot
   (docs/methods/refusion.md#parallel-completion). With a single selected slot
   (``reuse_verify``, default) the verify forward already computed round 0: its K/V of the l'
   tokens (the context and the prefix, in order) are kept and the slot's next token is taken from
   its distribution after the prefix, so completion starts at round 1 with the same tokens.

**Speculative completion** (``completion_drafts`` = n > 0 or null = all; not in the paper, whose completion
feeds one token per slot per forward; docs/methods/refusion.md#speculative-completion): each completion
forward also feeds, after a growing slot's newest token, up to n of the slot's remaining plan drafts (never
its last offset, whose token is always picked and left pending). The newest token's row picks the next
token; while it equals the draft fed at that offset, that draft's K/V (it saw the context and the slot's
tokens before it, all of them now the slot's) are kept and its row picks the next one; the rest are
dropped. The verify forward's rows after a single slot's verified prefix are read the same way (they
cost nothing). Greedy, the tokens are those of completion one token at a time (tested, both KV modes);
sampled, each token is still drawn from the completion's distribution after its prefix.

**Fused plan** (``fuse_plan``, default; not in the paper, whose plan is a forward of its own every
step; docs/methods/refusion.md#fused-plan): the verify forward of step t also feeds, after the
drafts, the masks of the slots step t + 1 would plan if every selected slot were accepted whole
without EOS. Attention is causal, so those masks see exactly the context that step t + 1's plan
forward would see (the committed context and the accepted drafts, at the same positions). When step
t does end that way, step t + 1 takes its drafts and scores from those rows (sampled only then, so
the random stream is the same) and runs no plan forward: the same tokens (tested, both KV modes),
one forward fewer. Otherwise the extra rows are discarded with the verify K/V they came with.

**First token from the AR head** (``first_token=ar``; not in the paper, where the plan's mask drafts
and scores it; docs/methods/refusion.md#first-token-from-the-ar-head): with one slot per block
(b = k) every slot starts right after the committed text, whose last token's row is the AR head's
prediction of the slot's first token. That row comes from the plan forward (the pending token; with
recomputation, the last context entry) or, after wholesale acceptance, from the verify forward's
last accepted token; it replaces the mask's draft and score of the first token. Verification then
checks the rest of the slot as before, so with greedy drafts and thresholds >= 0.5 (an accepted
probability is then the argmax) every output token is the AR head's argmax: the output is the
checkpoint's own AR greedy decode, and the masks only decide how many tokens one step commits. It
suits a conversion trained with ``recipe.ar_across_slots``, whose AR head is trained at slot starts.

KV reuse: committed K/V are never recomputed. After the plan forward that consumed the pending
tokens, the entries of the previous step are regrouped so that each completed slot's K/V are
contiguous, in generation order (slots of one step in position order), every entry at its original
RoPE position. ``kv_reuse=false`` (the paper's recomputation ablation, and the tests' reference)
recomputes the whole context with plain causal attention in generation order in every forward.
The K/V live in :mod:`pardec.inference.decoders.decode_steps` (``cuda_graphs``: its static cache, each
width a CUDA graph; docs/methods/refusion.md#kv-reuse).

EOS: when a decoded slot contains EOS at offset e, the target length becomes e + 1: masked slots
after it are dropped, and so are decoded tokens after it (and their K/V), but every undecoded slot
*before* it is still decoded (the official decoder's EOS index bug drops them). The final text is
the slots sorted by position, which cover [0, target length) without a gap.

Counting (docs/methods/conventions.md#counting): ``forwards`` = plan + verify + completion forwards (the
prefill of ``prompt[:-1]`` excluded: the last prompt token is the first plan forward's pending token);
``committed`` = output tokens up to and including EOS. ``stats``: ``steps`` (plan-and-infill
iterations), ``slots_accepted`` (slots completed, over all steps), ``wholesale_steps`` (steps ended
by verification), ``plan_forwards``, ``verify_forwards``, ``complete_forwards``, ``verify_reused``
(completions that started from the verify forward), ``plans_fused`` (plans taken from the previous
verify forward, no forward of their own), ``drafts_completed`` (draft tokens speculative completion kept).

Decisions where the paper is silent (docs/methods/refusion.md#decisions-where-the-paper-is-silent):
the ``<|mask|>`` logit is excluded from every distribution (a draft or completion never emits it);
in sample mode the score and verification probabilities come from the same transformed
(temperature / top-k / top-p) distribution the drafts are sampled from; ``block_size`` null = the
whole target (one block).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pardec.common.config_fields import Choice, ranged
from pardec.common.errors import ConfigError
from pardec.common.metadata import MASKED_AR, CheckpointMetadata
from pardec.inference.decoders.base import (
    DecoderConfig,
    DecodeResult,
    LoopTimer,
    PerSampleDecoder,
    forbid_mask,
    model_device,
)
from pardec.inference.decoders.decode_steps import SMALL, DynamicSteps, StaticSteps, StepsPool
from pardec.inference.decoders.sampling import SamplingMode, SamplingParams, probs_from_logits
from pardec.masks.core import additive_mask, require_dense_attention
from pardec.masks.refusion import SHARED, refusion_decode_mask
from pardec.models.loading import mask_token_id


class PlanScope(Choice):
    """Which masked slots a plan forward drafts (see ``ReFusionDecoderConfig.plan_scope``)."""

    all = "all"
    block = "block"


class FirstToken(Choice):
    """Where a slot's first token comes from (see ``ReFusionDecoderConfig.first_token``)."""

    mask = "mask"
    ar = "ar"



@dataclass
class ReFusionDecoderConfig(DecoderConfig):
    name: str = "refusion"
    # Slot size k; null = the checkpoint's pardec.slot_size.
    slot_size: Optional[int] = ranged(None, ge=1)
    # Semi-AR block size b (a multiple of k); null = max_new_tokens (one block).
    block_size: Optional[int] = ranged(None, ge=1)
    # tau: sets both thresholds below unless they are given (null).
    threshold: float = ranged(0.7, gt=0, le=1)
    plan_threshold: Optional[float] = ranged(None, gt=0, le=1)
    verify_threshold: Optional[float] = ranged(None, gt=0, le=1)
    # greedy (argmax drafts and completion) | sample (temperature / top-k / top-p).
    mode: SamplingMode = SamplingMode.greedy
    temperature: float = ranged(1.0, gt=0)
    top_k: int = ranged(0, ge=0, note="0 = off")
    top_p: float = ranged(1.0, gt=0, le=1, note="1 = off")
    # true: reuse the KV cache across steps; false: recompute the whole context every forward.
    kv_reuse: bool = True
    # block (official: the current block's masked slots) | all (the paper: every remaining masked slot).
    # Same tokens either way (causal attention); block's plan forwards are shorter.
    plan_scope: PlanScope = PlanScope.block
    # true: a single selected slot that verification left partial keeps the verify forward's K/V of
    # its verified prefix and takes its next token from that forward (one completion forward fewer,
    # the same tokens); false: completion re-feeds the prefix, as the paper words it.
    reuse_verify: bool = True
    # true: the verify forward also carries the masks of the slots the next step would plan if every
    # selected slot is accepted whole; when that happens their predictions replace the next plan
    # forward (the same tokens, one forward fewer); false: every step has its own plan forward.
    fuse_plan: bool = True
    # Speculative completion (beyond the paper): a completion forward also feeds, after each growing
    # slot's newest token, up to this many of the slot's remaining plan drafts, and keeps those the
    # completion picks again (also along the verify forward's rows, which cost nothing). Greedy: the
    # same tokens as 0, fewer and wider forwards; sampled: the same distribution. 0 = off (the paper:
    # one token per slot per completion forward); null = every remaining draft.
    completion_drafts: Optional[int] = ranged(0, ge=0, note="0 = off, null = all")
    # mask (the paper: a slot's first token is drafted and scored by its own mask) | ar (beyond the
    # paper: by the AR head at the token before it, the next-token prediction of the committed text;
    # needs block_size = slot size, so that every slot starts right after the committed text). With
    # ar, greedy drafts and thresholds >= 0.5 every output token is the AR head's argmax: the output
    # is the checkpoint's own AR greedy decode (tested).
    first_token: FirstToken = FirstToken.mask
    # Each step width as a CUDA graph over a static cache (pardec.inference.decoders.decode_steps; on a
    # GPU, so that TPS follows TPF; elsewhere the same static steps run eagerly). Batch 1.
    cuda_graphs: bool = False


def resolve_slot_size(model, slot_size: int | None) -> int:
    """``slot_size`` if given, else the checkpoint's recorded ``pardec.slot_size``."""
    if slot_size is None:
        slot_size = CheckpointMetadata.of_model(model).slot_size
        if slot_size is None:
            raise ConfigError(
                "config key 'decoder.slot_size' is null and the checkpoint records no 'pardec.slot_size' in its "
                "config.json: set decoder.slot_size=k (or convert with recipe=refusion)"
            )
    if slot_size < 1:
        raise ConfigError(f"config key 'decoder.slot_size' = {slot_size}; must be >= 1")
    return int(slot_size)


class _Context:
    """The committed context of one decode and the entries a step appends after it.

    Per entry: token, position and group (``SHARED`` or the slot being completed). With
    ``kv_reuse`` the K/V live in decode steps (:mod:`pardec.inference.decoders.decode_steps`,
    prompt[:-1] prefilled: a ``DynamicCache``, or with ``cuda_graphs`` the static cache); without it
    every forward recomputes all entries, with the same mask predicate over the same groups (eagerly
    keeping the logits of the last rows only, or with ``cuda_graphs`` as one static step from an
    empty cache).
    """

    def __init__(self, model, prompt_prefix: list[int], kv_reuse: bool,
                 steps: DynamicSteps | StaticSteps | None):
        self.model, self.kv_reuse, self.steps = model, kv_reuse, steps
        self.device = model_device(model)
        self.ids, self.pos, self.groups = (list(prompt_prefix), list(range(len(prompt_prefix))),
                                           [SHARED] * len(prompt_prefix))
        if kv_reuse:
            steps.reset(prompt_prefix)

    def __len__(self) -> int:
        return len(self.ids)

    def forward(self, ids: list[int], pos: list[int], groups: list[int], context_rows: int = 0) -> torch.Tensor:
        """Feed the entries after the context; they join it. Returns their logits ``[q, V]``, after
        those of the last ``context_rows`` context entries (recomputation only: with KV reuse the
        context is not recomputed)."""
        if context_rows and self.kv_reuse:
            raise ValueError("with KV reuse a forward has no logits for cached context entries")
        n, q = len(self.ids), len(ids)
        self.ids, self.pos, self.groups = self.ids + ids, self.pos + pos, self.groups + groups
        all_groups = torch.tensor([self.groups], dtype=torch.long, device=self.device)  # [1, n+q]
        mask_mod = refusion_decode_mask(all_groups)
        dtype = self.model.dtype
        if self.kv_reuse:
            mask = additive_mask(mask_mod, 1, q, n + q, dtype, self.device, kv_cache_len=n)  # [1, 1, q, n+q]
            return self.steps.forward(ids, mask[..., n:], [p - n for p in pos], mask[..., :n])  # [q, V]
        mask = additive_mask(mask_mod, 1, n + q, n + q, dtype, self.device)  # [1, 1, n+q, n+q]
        if self.steps is not None:  # cuda_graphs: the whole context as one static step
            self.steps.reset([])
            return self.steps.forward(self.ids, mask, self.pos)[n - context_rows:]  # [context_rows + q, V]
        out = self.model(
            input_ids=torch.tensor([self.ids], device=self.device),
            position_ids=torch.tensor([self.pos], device=self.device),
            attention_mask=mask, use_cache=False, logits_to_keep=q + context_rows,
        )
        return out.logits[0]  # [context_rows + q, V]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries."""
        if self.kv_reuse:
            self.steps.crop(length)
        del self.ids[length:], self.pos[length:], self.groups[length:]

    def select(self, keep: list[int]) -> None:
        """Keep the entries at ``keep``, in that order."""
        if self.kv_reuse:
            self.steps.select(keep)
        self.ids = [self.ids[i] for i in keep]
        self.pos = [self.pos[i] for i in keep]
        self.groups = [self.groups[i] for i in keep]

    def relabel(self, start: int, group: int) -> None:
        """Entries from ``start`` on join ``group`` (their K/V already saw exactly what it may see)."""
        self.groups[start:] = [group] * (len(self.groups) - start)

    def drop_beyond(self, end_position: int) -> None:
        """Drop the entries at positions >= ``end_position`` (tokens after an EOS)."""
        keep = [i for i, p in enumerate(self.pos) if p < end_position]
        if len(keep) < len(self.pos):
            self.select(keep)

    def regroup(self, start: int) -> None:
        """Entries from ``start`` on: each slot's entries contiguous, slots in position order after the
        shared ones (a stable sort), then every entry SHARED: committed context for later steps."""
        tail = sorted(range(start, len(self.ids)), key=lambda i: (self.groups[i] != SHARED, self.groups[i]))
        if tail != list(range(start, len(self.ids))):
            self.select(list(range(start)) + tail)
        self.groups = [SHARED] * len(self.ids)

    def absorb(self, entries: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Pending ``(token, position, group)`` entries: recompute mode takes them into the context
        at once (they are recomputed with it) and returns none; with KV reuse they stay pending
        until the next forward computes their K/V."""
        if self.kv_reuse:
            return entries
        for token, position, group in entries:
            self.ids.append(token)
            self.pos.append(position)
            self.groups.append(group)
        return []


@dataclass
class _Slot:
    index: int
    start: int  # generation offset of its first token
    stop: int  # one past its last offset (before EOS truncation)
    tokens: Optional[list[int]] = None  # decoded tokens, None while masked


def _plan_set(remaining: list[_Slot], block: int, scope: str) -> tuple[list[_Slot], list[_Slot]]:
    """(the current semi-AR block's slots among ``remaining``, the slots a plan forward covers)."""
    current = min(s.start // block for s in remaining)
    in_block = [s for s in remaining if s.start // block == current]
    return in_block, (remaining if scope == "all" else in_block)


def _spans(slots: list[_Slot], end: int) -> list[tuple[_Slot, list[int]]]:
    """Each slot with its generation offsets before the target length ``end``."""
    return [(s, list(range(s.start, min(s.stop, end)))) for s in slots]


def summarize_records(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-run aggregates of the decoder's records: mean slots accepted per plan-and-infill step, and the
    forward mix (what :meth:`ReFusionDecoder.summarize` adds to a run's metrics; a benchmark that pools
    records from several runs calls it on the pooled records)."""
    total = {key: sum(r["stats"].get(key, 0) for r in records)
             for key in ("steps", "slots_accepted", "wholesale_steps", "plan_forwards", "verify_forwards",
                         "complete_forwards", "plans_fused", "drafts_completed")}
    steps = total["steps"]
    return {
        "refusion_slots_per_step": total["slots_accepted"] / steps if steps else None,
        "refusion_wholesale_fraction": total["wholesale_steps"] / steps if steps else None,
        "refusion_steps_per_sample": steps / len(records) if records else None,
        **{f"refusion_{key}": total[key]
           for key in ("plan_forwards", "verify_forwards", "complete_forwards", "plans_fused",
                       "drafts_completed")},
    }


class ReFusionDecoder(PerSampleDecoder):
    name = "refusion"
    # The checkpoint kinds it decodes: a causal LM with a trained <|mask|> (a ReFusion export).
    checkpoint_kinds = (MASKED_AR,)

    def __init__(self, cfg: ReFusionDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.plan_threshold = cfg.threshold if cfg.plan_threshold is None else cfg.plan_threshold
        self.verify_threshold = cfg.threshold if cfg.verify_threshold is None else cfg.verify_threshold
        self.greedy = cfg.mode == "greedy"
        self.sampling = SamplingParams(self.greedy, cfg.temperature, cfg.top_k, cfg.top_p)
        self.steps = StepsPool(cfg.cuda_graphs)

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return summarize_records(records)

    # -- distributions ---------------------------------------------------------------------------

    def _probs(self, logits: torch.Tensor, mask_id: int) -> torch.Tensor:
        """``[n, V]`` logits -> the decoding distribution (``<|mask|>`` excluded), float32."""
        logits = forbid_mask(logits.float().clone(), mask_id)
        if self.greedy:
            return torch.softmax(logits, -1)
        return probs_from_logits(logits, self.sampling)

    def _pick(self, probs: torch.Tensor, generator: torch.Generator) -> list[int]:
        if self.greedy:
            return probs.argmax(-1).tolist()
        return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()

    # -- the loop --------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        if not prompt:
            raise ValueError("ReFusion decoding needs at least one prompt token (got an empty prompt)")
        require_dense_attention(model, "ReFusion decoding")
        k = resolve_slot_size(model, self.cfg.slot_size)
        mask_id = mask_token_id(model, self.tokenizer)
        length = self.cfg.max_new_tokens
        block = self.cfg.block_size or length
        if self.cfg.block_size is not None and block % k:
            raise ConfigError(f"config key 'decoder.block_size' = {block} is not a multiple of the slot size k = {k}")
        ar_first = self.cfg.first_token == "ar"
        if ar_first and block != k:
            raise ConfigError(f"config key 'decoder.first_token' = 'ar' needs decoder.block_size = the slot size "
                              f"k = {k} (got {block}): only then does every slot start right after the committed text")
        device = model_device(model)
        generator = torch.Generator(device=device).manual_seed(seed)
        n_prompt = len(prompt)
        slots = [_Slot(i, s, min(s + k, length)) for i, s in enumerate(range(0, length, k))]
        end = length  # target length; shrinks to EOS + 1
        stats = {"slot_size": k, "steps": 0, "slots_accepted": 0, "wholesale_steps": 0, "plan_forwards": 0,
                 "verify_forwards": 0, "complete_forwards": 0, "verify_reused": 0, "plans_fused": 0,
                 "drafts_completed": 0}
        fused = None  # (slot indices, end, probs [m, V]) of the next plan, from the last verify forward
        ar_next = None  # first_token=ar: (offset, probs [V]) of the AR head's prediction after the committed text

        # 1. Prefill prompt[:-1]; the last prompt token is the first pending token.
        widest = self._widest_step(n_prompt, length, block)
        cached = n_prompt + length if self.cfg.kv_reuse else 0  # the most keys a step finds cached
        steps = None
        if self.cfg.kv_reuse or self.cfg.cuda_graphs:
            steps = self.steps.get(model, cached + widest + SMALL, widest)
        ctx = _Context(model, prompt[:-1], self.cfg.kv_reuse, steps)
        pending = ctx.absorb([(prompt[-1], n_prompt - 1, SHARED)])  # (token, position, group) not yet in the cache
        step_start = len(ctx)

        with LoopTimer(device) as timer:
            while True:
                remaining = [s for s in slots if s.tokens is None and s.start < end]
                if not remaining:
                    break
                stats["steps"] += 1
                in_block, planned = _plan_set(remaining, block, self.cfg.plan_scope)

                # 2. Plan: [pending | masks of the planned slots]; drafts and first-token scores
                #    (or the rows the last verify forward computed for exactly these slots).
                ctx.drop_beyond(n_prompt + end)
                pending = [p for p in pending if p[1] < n_prompt + end]
                spans = _spans(planned, end)
                if fused is not None and fused[:2] == ([s.index for s in planned], end):
                    probs = fused[2]  # [m, V]
                    stats["plans_fused"] += 1
                else:
                    mask_pos = [n_prompt + o for _, offsets in spans for o in offsets]
                    # first_token=ar, recomputation: also the row of the last context entry
                    context_rows = int(ar_first and not self.cfg.kv_reuse)
                    lead = [(ctx.ids[-1], ctx.pos[-1])] if context_rows else [(p[0], p[1]) for p in pending]
                    logits = ctx.forward([p[0] for p in pending] + [mask_id] * len(mask_pos),
                                         [p[1] for p in pending] + mask_pos,
                                         [p[2] for p in pending] + [SHARED] * len(mask_pos), context_rows)
                    stats["plan_forwards"] += 1
                    if ar_first and lead:  # the last token before the masks predicts the slot's first one
                        ar_probs = self._probs(logits[len(lead) - 1: len(lead)], mask_id)[0]  # [V]
                        ar_next = (lead[-1][1] + 1 - n_prompt, ar_probs)
                    probs = self._probs(logits[len(lead):], mask_id)  # [m, V]
                    ctx.crop(len(ctx) - len(mask_pos))  # drop the masks, keep the pending tokens
                fused = None
                if ar_first:  # the first planned slot starts right after the committed text (b = k)
                    if ar_next is None or ar_next[0] != spans[0][0].start:
                        have = ar_next and ar_next[0]
                        raise RuntimeError(f"no AR prediction for offset {spans[0][0].start} (have {have})")
                    probs[0] = ar_next[1]
                tokens = self._pick(probs, generator)  # [m]
                token_probs = probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
                drafts, first_prob, row = {}, {}, 0
                for s, offsets in spans:
                    drafts[s.index] = tokens[row: row + len(offsets)]
                    first_prob[s.index] = token_probs[row]
                    row += len(offsets)
                ctx.regroup(step_start)  # the previous step's slots contiguous, in generation order
                pending, step_start = [], len(ctx)
                selected = [s for s in in_block if first_prob[s.index] > self.plan_threshold]
                if not selected:
                    selected = [max(in_block, key=lambda s: first_prob[s.index])]

                # 3. Verify the concatenated drafts in one forward (followed by the masks of the
                #    next plan when fused: they see the context and every draft, causally).
                base_len = len(ctx)
                ids = [t for s in selected for t in drafts[s.index]]
                pos = [n_prompt + s.start + j for s in selected for j in range(len(drafts[s.index]))]
                ahead = self._planned_after(remaining, selected, block) if self.cfg.fuse_plan else []
                ahead_pos = [n_prompt + o for _, offsets in _spans(ahead, end) for o in offsets]
                logits = ctx.forward(ids + [mask_id] * len(ahead_pos), pos + ahead_pos,
                                     [SHARED] * (len(ids) + len(ahead_pos)))
                stats["verify_forwards"] += 1
                probs = self._probs(logits[: len(ids)], mask_id)  # [q, V]
                verified, per_slot, row = [], [], 0
                for s in selected:
                    draft = drafts[s.index]
                    p = [first_prob[s.index]] + [float(probs[row + j - 1, draft[j]]) for j in range(1, len(draft))]
                    ok = [v > self.verify_threshold for v in p]
                    verified.extend(ok)
                    per_slot.append(next((j for j, v in enumerate(ok) if not v), len(ok)))
                    row += len(draft)
                prefix = next((j for j, v in enumerate(verified) if not v), len(verified))
                whole, covered = 0, 0
                for s in selected:
                    if covered + len(drafts[s.index]) > prefix:
                        break
                    covered += len(drafts[s.index])
                    whole += 1

                if whole:
                    # 3a. Accept whole slots with this forward's K/V (the next plan's masks dropped).
                    ctx.crop(base_len + covered)
                    done = {s.index: list(drafts[s.index]) for s in selected[:whole]}
                    stats["wholesale_steps"] += 1
                    if ar_first:  # the last accepted token's row: the next slot's first token
                        last = selected[whole - 1]
                        ar_next = (last.start + len(drafts[last.index]), probs[covered - 1])
                    if ahead and whole == len(selected):  # used only if EOS leaves the target as it is
                        fused = ([s.index for s in ahead], end, self._probs(logits[len(ids):], mask_id))
                else:
                    # 3b. Truncate to the common verified prefix and complete in parallel.
                    common = max(1, min(per_slot))
                    seqs = {s.index: list(drafts[s.index][:common]) for s in selected}
                    fed = 0
                    if self.cfg.reuse_verify and len(selected) == 1:
                        # One slot: the verify forward computed its prefix's K/V over the context and
                        # the prefix, as completion round 0 would, and the distribution of its next
                        # token. Keep both instead of re-feeding the prefix; with completion_drafts, also
                        # the draft entries after it that the completion picks again.
                        slot = selected[0]
                        seq, draft = seqs[slot.index], drafts[slot.index]
                        kept = 0
                        if not any(t in eos_token_ids for t in seq) and len(seq) < len(draft):
                            spec = self._speculated(len(seq), draft, len(draft))
                            rows = probs[common - 1: common + len(spec)]  # the prefix's last row, then the drafts'
                            kept = self._continue(seq, draft, rows, self._pick(rows[:1], generator)[0],
                                                  len(draft), eos_token_ids, generator)
                            stats["verify_reused"] += 1
                            stats["drafts_completed"] += kept
                        ctx.crop(base_len + common + kept)
                        ctx.relabel(base_len, slot.index)
                        fed = common + kept
                    else:
                        ctx.crop(base_len)
                    done, pending = self._complete(ctx, base_len, selected, seqs, drafts, fed, n_prompt, end,
                                                   mask_id, eos_token_ids, generator, stats)

                # 4. Commit; EOS truncates the target length (undecoded slots before it stay).
                for index, toks in done.items():
                    slot = slots[index]
                    eos_at = next((j for j, t in enumerate(toks) if t in eos_token_ids), None)
                    if eos_at is not None:
                        toks = toks[: eos_at + 1]
                        end = min(end, slot.start + eos_at + 1)
                    slot.tokens = toks
                    stats["slots_accepted"] += 1
                pending = ctx.absorb(pending)
                if not self.cfg.kv_reuse:
                    ctx.regroup(step_start)  # recompute: completed slots are plain context at once
                    step_start = len(ctx)

        out: list[int] = []
        for s in slots:
            if s.start >= end:
                break
            assert s.tokens is not None and len(s.tokens) >= min(s.stop, end) - s.start, "undecoded slot before the end"
            out.extend(s.tokens[: end - s.start])
        hit_eos = bool(out) and out[-1] in eos_token_ids
        return DecodeResult(tokens=out, forwards=sum(stats[f"{p}_forwards"] for p in ("plan", "verify", "complete")),
                            committed=len(out), wall_time_s=timer.elapsed, hit_eos=hit_eos, stats=stats)

    def _widest_step(self, n_prompt: int, length: int, block: int) -> int:
        """The most entries one forward feeds: a plan's (pending tokens, at most one per slot of a block,
        and the planned masks) or a verify's (the drafts, at most a block, and the next plan's masks);
        recomputation feeds the whole context too (the prompt and at most ``length`` generated entries)."""
        planned = length if self.cfg.plan_scope == "all" else block
        widest = block + planned
        return widest if self.cfg.kv_reuse else n_prompt + length + widest

    def _planned_after(self, remaining: list[_Slot], selected: list[_Slot], block: int) -> list[_Slot]:
        """The slots the next step plans if every selected slot is accepted whole without EOS."""
        taken = {s.index for s in selected}
        left = [s for s in remaining if s.index not in taken]
        return _plan_set(left, block, self.cfg.plan_scope)[1] if left else []

    def _speculated(self, offset: int, draft: list[int], target: int) -> list[int]:
        """The draft offsets a completion forward feeds after a slot's newest token at ``offset - 1``
        (``completion_drafts``): from ``offset`` to the slot's second-to-last, so that a completed slot's
        last token is always one its completion picked, left pending."""
        stop = min(len(draft), target - 1)
        if self.cfg.completion_drafts is not None:
            stop = min(stop, offset + self.cfg.completion_drafts)
        return list(range(offset, stop))

    def _continue(self, seq: list[int], draft: list[int], rows: torch.Tensor, first: int, target: int,
                  eos_token_ids: Collection[int], generator: torch.Generator) -> int:
        """Append ``first`` (picked from ``rows[0]``, the row of the slot's newest fed token) to the slot's
        tokens ``seq``; then, while the pick equals the draft token fed at its offset (``rows[i]`` is the
        row of the i-th draft entry fed after the newest token) and the slot goes on, keep that entry
        and pick the next token from its row. Returns how many draft entries were kept: the tokens are
        those completion would pick one forward at a time (the same argmax; sampled, the same
        distribution)."""
        kept, token = 0, first
        while True:
            seq.append(token)
            offset = len(seq) - 1
            if kept + 1 >= len(rows) or token != draft[offset] or len(seq) >= target or token in eos_token_ids:
                return kept
            kept += 1
            token = self._pick(rows[kept: kept + 1], generator)[0]

    def _complete(self, ctx: _Context, base: int, selected: list[_Slot], seqs: dict[int, list[int]],
                  drafts: dict[int, list[int]], fed: int, n_prompt: int, end: int, mask_id: int,
                  eos_token_ids: Collection[int], generator: torch.Generator, stats: dict[str, Any]):
        """Complete the selected slots from ``seqs`` (their tokens so far, of which the first ``fed``
        are already in the context after ``base``, in the slot's group), one forward per round, each
        slot seeing the context and itself. With ``completion_drafts`` a round also feeds, after each
        growing slot's newest token, its remaining ``drafts`` tokens (speculative decoding with the
        plan's drafts): those the completion picks again keep their K/V, the rest are dropped.
        Returns ``({slot: tokens}, pending tokens)``."""
        target = {s.index: min(s.stop, end) - s.start for s in selected}

        def unfinished(s: _Slot) -> bool:
            toks = seqs[s.index]
            return len(toks) < target[s.index] and not any(t in eos_token_ids for t in toks)

        feed = [(s, j) for s in selected for j in range(fed, len(seqs[s.index]))]  # round 0: what is not fed
        while any(unfinished(s) for s in selected):
            last_row = {s.index: r for r, (s, _) in enumerate(feed)}  # each slot's last fed token
            growing = [s for s in selected if unfinished(s) and s.index in last_row]
            spec = {s.index: self._speculated(len(seqs[s.index]), drafts[s.index], target[s.index]) for s in growing}
            rows = [(s, j, seqs[s.index][j]) for s, j in feed]
            spec_rows = {}  # each growing slot's draft rows, after every fed token
            for s in growing:
                spec_rows[s.index] = list(range(len(rows), len(rows) + len(spec[s.index])))
                rows += [(s, j, drafts[s.index][j]) for j in spec[s.index]]
            start = len(ctx)
            logits = ctx.forward([t for _, _, t in rows], [n_prompt + s.start + j for s, j, _ in rows],
                                 [s.index for s, _, _ in rows])
            stats["complete_forwards"] += 1
            probs = self._probs(logits[[last_row[s.index] for s in growing]], mask_id)  # [g, V]
            drop = []
            for g, (s, token) in enumerate(zip(growing, self._pick(probs, generator), strict=True)):
                own = spec_rows[s.index]
                slot_rows = torch.cat([probs[g: g + 1], self._probs(logits[own], mask_id)])  # [1 + spec, V]
                kept = self._continue(seqs[s.index], drafts[s.index], slot_rows, token, target[s.index],
                                      eos_token_ids, generator)
                stats["drafts_completed"] += kept
                drop += [start + r for r in own[kept:]]
            if drop:
                dropped = set(drop)
                ctx.select([i for i in range(len(ctx)) if i not in dropped])
            feed = [(s, len(seqs[s.index]) - 1) for s in growing if unfinished(s)]
        # Tokens never fed (each grown slot's newest; all of them when no round ran) are pending.
        fed = set(zip(ctx.pos[base:], ctx.groups[base:]))
        pending = [(t, n_prompt + s.start + j, s.index) for s in selected for j, t in enumerate(seqs[s.index])
                   if (n_prompt + s.start + j, s.index) not in fed]
        return seqs, pending
