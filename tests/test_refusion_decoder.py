"""ReFusion plan-and-infill decoder on tiny random models: KV reuse vs recomputation, the cache it
builds vs a forward over the same tokens, EOS inside a selected slot set, valid outputs, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

import pardec.inference.decoders.refusion as refusion_module
from pardec.common.constants import MASK_TOKEN
from pardec.common.errors import ConfigError
from pardec.common.kv_cache import cache_argument
from pardec.common.metadata import CheckpointMetadata
from pardec.inference.decoders.decode_steps import step_width
from pardec.inference.decoders.refusion import ReFusionDecoder, ReFusionDecoderConfig
from pardec.inference.decoders.registry import build_decoder
from pardec.masks.refusion import SHARED
from tests.conftest import tiny_model, tiny_tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer((MASK_TOKEN,))


def converted_model(tokenizer, seed=0, slot_size=4):
    model = tiny_model(len(tokenizer), seed=seed)
    CheckpointMetadata(recipe="refusion", mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN),
                       slot_size=slot_size).write_to(model)
    return model


PROMPTS = [[3, 5, 7, 9, 11], [4, 4, 12, 20, 6, 8, 2], [13]]


class RecordingContext(refusion_module._Context):
    """Logs every entry it ever held: token, position, iteration (regroups so far), group at the time
    it was computed, the forward that computed it and the forward before which it was dropped."""

    made: list[RecordingContext] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = self.forwards = 0
        self.log = [[t, p, -1, SHARED, -1, None] for t, p in zip(self.ids, self.pos)]
        self.where = list(range(len(self.ids)))  # log index of each current entry
        RecordingContext.made.append(self)

    def forward(self, ids, pos, groups, context_rows=0):
        self.where = self.where + list(range(len(self.log), len(self.log) + len(ids)))
        self.log += [[t, p, self.step, g, self.forwards, None] for t, p, g in zip(ids, pos, groups)]
        out = super().forward(ids, pos, groups, context_rows)
        self.forwards += 1
        return out

    def _died(self, kept):
        for i in set(range(len(self.where))) - set(kept):
            self.log[self.where[i]][5] = self.forwards

    def crop(self, length):
        self._died(range(length))
        self.where = self.where[:length]
        super().crop(length)

    def select(self, keep):
        self._died(keep)
        self.where = [self.where[i] for i in keep]
        super().select(keep)

    def regroup(self, start):
        super().regroup(start)
        self.step += 1

    def relabel(self, start, group):
        for i in self.where[start:]:
            self.log[i][3] = group
        super().relabel(start, group)

    def absorb(self, entries):
        if not self.kv_reuse:  # taken into the context without a forward
            self.where = self.where + list(range(len(self.log), len(self.log) + len(entries)))
            self.log += [[t, p, self.step, g, self.forwards, None] for t, p, g in entries]
        return super().absorb(entries)


@pytest.fixture
def recording(monkeypatch):
    RecordingContext.made = []
    monkeypatch.setattr(refusion_module, "_Context", RecordingContext)
    return RecordingContext.made


def decode(model, tokenizer, prompt, seed=0, **cfg):
    decoder = ReFusionDecoder(ReFusionDecoderConfig(**{"max_new_tokens": 24, **cfg}), tokenizer)
    return decoder.decode_one(model, prompt, {EOS}, seed)


def reference_kv(model, ctx):
    """K/V of one forward over every entry the context ever held, where entry i sees entry j iff j
    existed when i was computed and j is from an earlier iteration, or from the same one, in the same
    group, at a position <= i's. Returned for the entries the context holds now, in its order."""
    log = ctx.log
    n = len(log)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i, j in itertools.product(range(n), range(n)):
        _, pi, si, gi, bi, _ = log[i]
        _, pj, sj, gj, bj, dj = log[j]
        alive = bj <= bi and (dj is None or dj > bi)
        allowed[i, j] = alive and (sj < si or (sj == si and gj == gi and pj <= pi))
    mask = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[e[0] for e in log]]), position_ids=torch.tensor([[e[1] for e in log]]),
              attention_mask=mask, **cache_argument(cache), use_cache=True)
    index = torch.tensor(ctx.where)
    return [(layer.keys[:, :, index], layer.values[:, :, index]) for layer in cache.layers]


def assert_cache_matches_reference(model, ctx):
    """The context's cached K/V (its steps' first ``len(ctx)`` keys, dynamic or static) equal the reference's."""
    ref = reference_kv(model, ctx)
    layers = ctx.steps.cache.layers
    assert len(layers) == len(ref) and ctx.steps.length == len(ctx)
    for ours, (keys, values) in zip(layers, ref, strict=True):
        torch.testing.assert_close(ours.keys[:, :, : len(ctx)], keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values[:, :, : len(ctx)], values, atol=1e-5, rtol=1e-5)


def assert_valid(result, tokenizer, max_new_tokens=24):
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert mask_id not in result.tokens
    assert result.committed == len(result.tokens) <= max_new_tokens
    assert EOS not in result.tokens[:-1]  # nothing after EOS
    assert result.hit_eos == (bool(result.tokens) and result.tokens[-1] == EOS)
    if not result.hit_eos:
        assert len(result.tokens) == max_new_tokens  # no gap: every slot decoded
    s = result.stats
    assert result.forwards == s["plan_forwards"] + s["verify_forwards"] + s["complete_forwards"] >= 2


# --- KV reuse vs recomputation ------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("block_size", [None, 8])
def test_one_slot_per_step_kv_reuse_equals_recompute(tokenizer, recording, prompt, block_size):
    """Plan threshold 1 selects the single best slot, verify threshold 1 never accepts wholesale:
    every step completes one slot, so KV reuse is exact and must equal the recomputation."""
    model = converted_model(tokenizer)
    cfg = {"threshold": 1.0, "block_size": block_size}
    reuse = decode(model, tokenizer, prompt, kv_reuse=True, **cfg)
    recompute = decode(model, tokenizer, prompt, kv_reuse=False, **cfg)
    assert reuse.tokens == recompute.tokens
    assert reuse.forwards == recompute.forwards and reuse.stats == recompute.stats
    assert reuse.stats["slots_accepted"] == reuse.stats["steps"]
    ctx = recording[0]
    assert ctx.kv_reuse
    assert_cache_matches_reference(model, ctx)
    # Each slot's entries are contiguous (generation order), at the original positions.
    gen = [p - len(prompt) for p in ctx.pos if p >= len(prompt)]
    slots = [g // 4 for g in gen]
    assert slots == [s for s, _ in itertools.groupby(slots) for _ in range(slots.count(s))]


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_completion_from_the_verify_forward_saves_one_forward_with_the_same_tokens(tokenizer, kv_reuse):
    """reuse_verify keeps the verify forward's prefix K/V and next-token distribution for a single
    partially verified slot: the tokens must be those of completion from scratch (reuse_verify=false),
    with exactly one completion forward fewer per such step."""
    model = converted_model(tokenizer, seed=7)
    used = 0
    for prompt, (threshold, block) in itertools.product(PROMPTS, [(1.0, 4), (0.3, 4), (0.1, 8), (0.5, None)]):
        cfg = {"threshold": threshold, "block_size": block, "kv_reuse": kv_reuse}
        fast = decode(model, tokenizer, prompt, reuse_verify=True, **cfg)
        slow = decode(model, tokenizer, prompt, reuse_verify=False, **cfg)
        assert fast.tokens == slow.tokens
        assert slow.stats["verify_reused"] == 0
        assert slow.forwards - fast.forwards == fast.stats["verify_reused"]
        used += fast.stats["verify_reused"]
    assert used > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_completion_from_the_verify_forward_cache_equals_reference(tokenizer, recording, seed):
    """One slot per step (b = k) with partial verification: the kept verify K/V of the prefix and the
    completion's K/V must equal a forward over the same tokens with the same visibility."""
    model = converted_model(tokenizer, seed=seed)
    result = decode(model, tokenizer, PROMPTS[seed], threshold=0.3, block_size=4)
    assert_valid(result, tokenizer)
    assert result.stats["verify_reused"] > 0
    assert_cache_matches_reference(model, recording[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parallel_completion_cache_equals_reference(tokenizer, recording, seed):
    """Every slot of the block selected at once, completed in parallel: each slot's K/V must equal a
    forward where it sees the context before its step and itself (the paper's approximation)."""
    model = converted_model(tokenizer, seed=seed)
    result = decode(model, tokenizer, PROMPTS[seed % len(PROMPTS)], plan_threshold=1e-6, verify_threshold=1.0,
                    block_size=12)
    assert_valid(result, tokenizer)
    assert result.stats["slots_accepted"] > result.stats["steps"]  # parallel slots happened
    assert result.stats["complete_forwards"] > 0
    assert_cache_matches_reference(model, recording[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_wholesale_acceptance_cache_equals_reference(tokenizer, recording, seed):
    """Thresholds close to 0: every draft verifies, whole slots are accepted from the verify forward."""
    model = converted_model(tokenizer, seed=seed)
    result = decode(model, tokenizer, PROMPTS[seed], threshold=1e-9, block_size=8)
    assert_valid(result, tokenizer)
    assert result.stats["wholesale_steps"] == result.stats["steps"] and result.stats["complete_forwards"] == 0
    # every step after the first takes its plan from the previous verify forward (fuse_plan)
    assert result.stats["plans_fused"] == result.stats["steps"] - 1 > 0
    assert result.forwards == 2 * result.stats["steps"] - result.stats["plans_fused"]
    assert_cache_matches_reference(model, recording[0])


@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_fused_plan_saves_the_plan_forward_with_the_same_tokens(tokenizer, monkeypatch, kv_reuse, mode):
    """fuse_plan plans the next step's slots in the verify forward: when every selected slot is
    accepted whole, the tokens must be those of a separate plan forward (fuse_plan=false), sampled
    ones included (the random stream is the same), every distribution drawn from equal to 1e-5,
    with exactly one plan forward fewer per use."""
    model = converted_model(tokenizer, seed=3)
    drawn = []
    pick = ReFusionDecoder._pick
    monkeypatch.setattr(ReFusionDecoder, "_pick",
                        lambda self, probs, g: drawn.append(probs.clone()) or pick(self, probs, g))

    def run(prompt, **cfg):
        drawn.clear()
        return decode(model, tokenizer, prompt, seed=5, **cfg), list(drawn)

    used = 0
    settings = [(1e-9, 8, "block"), (0.05, 4, "block"), (0.3, 8, "block"), (0.05, None, "block"), (0.05, 4, "all")]
    for prompt, (threshold, block, scope) in itertools.product(PROMPTS, settings):
        cfg = {"threshold": threshold, "block_size": block, "plan_scope": scope, "kv_reuse": kv_reuse, "mode": mode}
        fast, fast_drawn = run(prompt, fuse_plan=True, **cfg)
        slow, slow_drawn = run(prompt, fuse_plan=False, **cfg)
        assert fast.tokens == slow.tokens
        assert len(fast_drawn) == len(slow_drawn)
        for a, b in zip(fast_drawn, slow_drawn, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert slow.stats["plans_fused"] == 0
        assert slow.forwards - fast.forwards == fast.stats["plans_fused"]
        assert fast.stats["plan_forwards"] + fast.stats["plans_fused"] == fast.stats["steps"] == slow.stats["steps"]
        used += fast.stats["plans_fused"]
    assert used > 0


SPECULATIVE_SETTINGS = [  # (decoder settings, one slot per step)
    ({"threshold": 1.0, "block_size": 4}, True),  # every slot completed from its first token
    ({"threshold": 0.3, "block_size": 4}, True),  # partial verification: the verify forward's rows first
    ({"threshold": 0.5, "block_size": 4, "first_token": "ar"}, True),
    ({"threshold": 0.5, "block_size": 8}, False),
    ({"plan_threshold": 1e-6, "verify_threshold": 1.0, "block_size": 12}, False),  # parallel completion
    ({"plan_threshold": 1e-6, "verify_threshold": 1.0, "block_size": 12, "reuse_verify": False}, False),
]


@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("drafts", [1, 2, None])
def test_speculative_completion_decodes_the_same_tokens_with_fewer_forwards(tokenizer, kv_reuse, drafts):
    """completion_drafts feeds a slot's remaining plan drafts after its newest token and keeps those the
    completion picks again: greedy, the tokens must be those of completion one token per forward
    (completion_drafts=0), with the same steps; where every step completes one slot, each kept draft
    saves exactly one forward. Seeds 0 and 6 are tiny models whose drafts the completion often picks."""
    used = 0
    for seed, prompt, (settings, one_slot) in itertools.product([0, 6], PROMPTS, SPECULATIVE_SETTINGS):
        model = converted_model(tokenizer, seed=seed)
        cfg = {**settings, "kv_reuse": kv_reuse}
        fast = decode(model, tokenizer, prompt, completion_drafts=drafts, **cfg)
        slow = decode(model, tokenizer, prompt, **cfg)
        assert fast.tokens == slow.tokens, (seed, prompt, settings)
        assert_valid(fast, tokenizer)
        assert slow.stats["drafts_completed"] == 0 and fast.stats["steps"] == slow.stats["steps"]
        assert fast.forwards <= slow.forwards
        if one_slot:
            assert slow.forwards - fast.forwards == fast.stats["drafts_completed"], (seed, prompt, settings)
        used += fast.stats["drafts_completed"]
    assert used > 0


@pytest.mark.parametrize("case", range(len(SPECULATIVE_SETTINGS)))
def test_speculative_completion_cache_equals_reference(tokenizer, recording, case):
    """The kept draft entries' K/V (and those of every entry after the dropped ones) must equal a
    forward over the same tokens where each entry sees what it saw when computed."""
    model = converted_model(tokenizer, seed=6)
    used = 0
    for prompt in PROMPTS:
        result = decode(model, tokenizer, prompt, completion_drafts=None, **SPECULATIVE_SETTINGS[case][0])
        assert_valid(result, tokenizer)
        assert_cache_matches_reference(model, recording[-1])
        used += result.stats["drafts_completed"]
    assert used > 0


def test_speculative_completion_sampled_is_valid_and_seeded(tokenizer):
    model = converted_model(tokenizer, seed=6)
    for prompt, (settings, _) in itertools.product(PROMPTS, SPECULATIVE_SETTINGS):
        cfg = {**settings, "completion_drafts": None, "mode": "sample", "temperature": 0.7}
        a, b = (decode(model, tokenizer, prompt, seed=3, **cfg) for _ in range(2))
        assert a.tokens == b.tokens
        assert_valid(a, tokenizer)


def test_recompute_context_holds_the_output_in_position_order(tokenizer, recording):
    """kv_reuse=false keeps no cache; its context (recomputed every forward) holds every committed
    token at its own position, so the output read in position order is the decoded text."""
    model = converted_model(tokenizer, seed=3)
    result = decode(model, tokenizer, PROMPTS[0], plan_threshold=1e-6, verify_threshold=1.0, block_size=12,
                    kv_reuse=False)
    assert_valid(result, tokenizer)
    ctx = recording[0]
    assert ctx.steps is None
    by_pos = dict(zip(ctx.pos, ctx.ids))
    assert [by_pos[len(PROMPTS[0]) + j] for j in range(len(result.tokens))] == result.tokens


# --- EOS ------------------------------------------------------------------------------------------


class EOSAt(torch.nn.Module):
    """Wraps a model: a ``<|mask|>`` query at ``position`` predicts EOS with near certainty."""

    def __init__(self, inner, mask_id: int, position: int):
        super().__init__()
        self.inner, self.mask_id, self.position = inner, mask_id, position
        self.config = inner.config

    @property
    def dtype(self):
        return self.inner.dtype

    def forward(self, input_ids, position_ids, **kwargs):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)
        q = out.logits.shape[1]
        hit = (input_ids[:, -q:] == self.mask_id) & (position_ids[:, -q:] == self.position)  # [b, q]
        boost = torch.full((out.logits.shape[-1],), -20.0)
        boost[EOS] = 20.0
        out.logits[hit] = boost.to(out.logits)
        return out


@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("plan_threshold", [0.9, 1e-6])
def test_eos_inside_the_selected_slots_keeps_every_slot_before_it(tokenizer, kv_reuse, plan_threshold):
    """EOS drafted as the first token of slot 2 (offset 8, k = 4). With plan threshold 0.9 only that
    slot is selected (slots 0 and 1 are still masked when EOS is committed); with 1e-6 the whole
    block is selected and completed in parallel. Either way slots 0 and 1 must be decoded: the
    output is exactly 9 tokens (8 + EOS), no gap."""
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    prompt = PROMPTS[0]
    model = EOSAt(converted_model(tokenizer, seed=4), mask_id, len(prompt) + 8)
    result = decode(model, tokenizer, prompt, plan_threshold=plan_threshold, verify_threshold=1.0,
                    kv_reuse=kv_reuse)
    assert result.hit_eos and len(result.tokens) == 9 and result.tokens[-1] == EOS
    assert_valid(result, tokenizer)
    if plan_threshold == 0.9:
        # The first step decoded slot 2 alone; slots 0 and 1 came after it.
        assert result.stats["steps"] >= 3 and result.stats["slots_accepted"] == result.stats["steps"]


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_fused_plan_is_not_used_after_eos_shortens_the_target(tokenizer, kv_reuse):
    """Slot 2 (offsets 8-11, k = 4, b = 12) drafted alone with EOS first and accepted whole: the target
    shrinks to 9 and step 2 plans slots 0 and 1, the very slots step 1's verify forward planned, but
    over a context without slot 2's tokens after EOS, so step 2 needs a plan forward of its own; every
    later step (whole acceptance, threshold ~0) takes its plan from the verify forward before it."""
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    prompt = PROMPTS[0]
    model = EOSAt(converted_model(tokenizer, seed=4), mask_id, len(prompt) + 8)
    result = decode(model, tokenizer, prompt, plan_threshold=0.9, verify_threshold=1e-9, block_size=12,
                    kv_reuse=kv_reuse)
    assert result.hit_eos and len(result.tokens) == 9
    assert result.stats["wholesale_steps"] == result.stats["steps"] >= 3
    assert result.stats["plans_fused"] == result.stats["steps"] - 2


# --- valid outputs over a grid of settings ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("plan_scope", ["all", "block"])
def test_outputs_are_valid(tokenizer, mode, kv_reuse, plan_scope):
    model = converted_model(tokenizer, seed=5)
    for prompt, (threshold, block, k, length) in itertools.product(
        PROMPTS, [(0.05, None, 4, 24), (0.3, 8, 4, 21), (0.01, 6, 3, 17), (1.0, 5, 5, 13)]
    ):
        result = decode(model, tokenizer, prompt, threshold=threshold, block_size=block, slot_size=k,
                        max_new_tokens=length, mode=mode, temperature=1.5, kv_reuse=kv_reuse, plan_scope=plan_scope)
        assert_valid(result, tokenizer, length)


@pytest.mark.parametrize("kv_reuse", [True, False])
def test_block_plan_scope_decodes_the_same_tokens(tokenizer, kv_reuse):
    """Attention is causal over [context | masks in position order] and the current block's slots are
    the first remaining ones, so masks of later blocks cannot change their plan: ``plan_scope=block``
    (shorter plan forwards) must decode exactly what ``plan_scope=all`` does."""
    model = converted_model(tokenizer, seed=3)
    for prompt, (threshold, block) in itertools.product(PROMPTS, [(0.05, 4), (0.3, 8), (1.0, 8), (0.2, 12)]):
        full, scoped = (decode(model, tokenizer, prompt, threshold=threshold, block_size=block, kv_reuse=kv_reuse,
                               plan_scope=scope) for scope in ("all", "block"))
        assert scoped.tokens == full.tokens and scoped.stats == full.stats


def test_sampling_is_seeded(tokenizer):
    model = converted_model(tokenizer, seed=6)
    a = decode(model, tokenizer, PROMPTS[1], mode="sample", threshold=0.05, seed=11)
    b = decode(model, tokenizer, PROMPTS[1], mode="sample", threshold=0.05, seed=11)
    c = [decode(model, tokenizer, PROMPTS[1], mode="sample", threshold=0.05, seed=s).tokens for s in range(5)]
    assert a.tokens == b.tokens and len({tuple(t) for t in c}) > 1


def test_registry_builds_it_and_summarize_aggregates(tokenizer):
    model = converted_model(tokenizer, seed=7)
    decoder = build_decoder({"name": "refusion", "max_new_tokens": 16, "threshold": 0.05}, tokenizer)
    results = decoder.decode(model, PROMPTS, {EOS}, [0, 1, 2])
    records = [{"stats": r.stats, "forwards": r.forwards} for r in results]
    summary = decoder.summarize(records)
    steps = sum(r.stats["steps"] for r in results)
    assert summary["refusion_slots_per_step"] == pytest.approx(sum(r.stats["slots_accepted"] for r in results) / steps)
    assert summary["refusion_plan_forwards"] + summary["refusion_plans_fused"] == steps
    assert summary["refusion_drafts_completed"] == sum(r.stats["drafts_completed"] for r in results)


# --- bad input gets a named error ----------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("threshold", 0.0), ("threshold", 1.5), ("plan_threshold", -0.1),
                                       ("verify_threshold", 2.0)])
def test_thresholds_outside_unit_interval(tokenizer, key, value):
    with pytest.raises(ConfigError, match=rf"decoder.{key}.*\(0, 1\]"):
        ReFusionDecoder(ReFusionDecoderConfig(**{key: value}), tokenizer)


def test_checkpoint_without_mask_token(tokenizer):
    model = tiny_model(len(tokenizer))  # plain AR: no pardec record
    with pytest.raises(ConfigError, match="mask_token_id"):
        decode(model, tokenizer, PROMPTS[0], slot_size=4)


def test_checkpoint_without_slot_size(tokenizer):
    model = tiny_model(len(tokenizer))
    CheckpointMetadata(mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN)).write_to(model)
    with pytest.raises(ConfigError, match="decoder.slot_size.*pardec.slot_size"):
        decode(model, tokenizer, PROMPTS[0])


def test_block_not_a_multiple_of_the_slot(tokenizer):
    with pytest.raises(ConfigError, match="decoder.block_size.*multiple"):
        decode(converted_model(tokenizer), tokenizer, PROMPTS[0], block_size=6)


def test_ar_first_token_needs_one_slot_per_block(tokenizer):
    with pytest.raises(ConfigError, match="decoder.first_token.*block_size"):
        decode(converted_model(tokenizer), tokenizer, PROMPTS[0], block_size=8, first_token="ar")


@pytest.mark.parametrize("key,value", [("mode", "beam"), ("plan_scope", "half"), ("slot_size", 0),
                                       ("first_token", "plan")])
def test_bad_choices(tokenizer, key, value):
    with pytest.raises(ConfigError, match=f"decoder.{key}"):
        ReFusionDecoder(ReFusionDecoderConfig(**{key: value}), tokenizer)


# --- first_token=ar: the slot's first token from the AR head ------------------------------------


def naive_next(model, tokenizer, tokens):
    """Argmax next token of a plain causal forward over ``tokens`` (``<|mask|>`` excluded, as the decoder)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].clone()
    logits[tokenizer.convert_tokens_to_ids(MASK_TOKEN)] = float("-inf")
    return int(logits.argmax())


def naive_greedy(model, tokenizer, prompt, max_new_tokens=24):
    out = []
    while len(out) < max_new_tokens and EOS not in out:
        out.append(naive_next(model, tokenizer, prompt + out))
    return out


@pytest.mark.parametrize("drafts", [0, None])
@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("threshold", [0.5, 0.9])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_first_token_with_thresholds_from_one_half_is_own_ar_greedy(tokenizer, prompt, threshold, kv_reuse,
                                                                       drafts):
    """Against plain forwards over the growing text, speculative completion (drafts=None) included;
    seed 6 is a tiny model whose drafts the completion often picks."""
    for seed in (3, 6):
        model = converted_model(tokenizer, seed=seed)
        result = decode(model, tokenizer, prompt, threshold=threshold, kv_reuse=kv_reuse, block_size=4,
                        first_token="ar", completion_drafts=drafts)
        assert result.tokens == naive_greedy(model, tokenizer, prompt)
        assert_valid(result, tokenizer)


@pytest.mark.parametrize("fuse_plan", [True, False])
@pytest.mark.parametrize("kv_reuse", [True, False])
def test_ar_first_token_after_wholesale_acceptance(tokenizer, kv_reuse, fuse_plan):
    """Low thresholds accept drafts wholesale (the first token then comes from the verify forward's
    last row, or with fuse_plan from the fused plan): every slot's first token is still the argmax of a
    plain forward over the text before it."""
    model = converted_model(tokenizer, seed=1)
    for prompt in PROMPTS:
        result = decode(model, tokenizer, prompt, threshold=1e-6, kv_reuse=kv_reuse, fuse_plan=fuse_plan,
                        block_size=4, first_token="ar")
        assert result.stats["wholesale_steps"] >= 2
        assert_valid(result, tokenizer)
        for start in range(0, len(result.tokens), 4):
            assert result.tokens[start] == naive_next(model, tokenizer, prompt + result.tokens[:start]), start
        if fuse_plan:
            assert result.stats["plans_fused"] >= 1


@pytest.mark.parametrize("threshold", [0.05, 0.5, 1.0])
def test_ar_first_token_sampled_is_valid_and_the_same_with_kv_reuse(tokenizer, threshold):
    """Sample mode: the first token is drawn from the AR head's (transformed) distribution; outputs
    are valid, and KV reuse draws exactly what recomputation does at b = k with the same seed."""
    model = converted_model(tokenizer, seed=2)
    for prompt, seed in itertools.product(PROMPTS, [0, 1]):
        runs = [decode(model, tokenizer, prompt, seed=seed, threshold=threshold, block_size=4, first_token="ar",
                       mode="sample", temperature=1.5, kv_reuse=kv_reuse) for kv_reuse in (True, False)]
        assert runs[0].tokens == runs[1].tokens
        assert_valid(runs[0], tokenizer)


# --- cuda_graphs: the static steps (run eagerly on CPU) -------------------------------------------

STATIC_CASES = [
    {"threshold": 1.0, "block_size": 8},  # one slot per step, completed
    {"threshold": 0.3, "block_size": 4},  # partial verification, completion from the verify forward
    {"plan_threshold": 1e-6, "verify_threshold": 1.0, "block_size": 12},  # parallel completion
    {"threshold": 1e-9, "block_size": 8},  # wholesale acceptance, fused plans
    {"threshold": 0.5, "plan_scope": "all"},
    {"threshold": 0.7, "block_size": 4, "first_token": "ar"},
    {"threshold": 0.5, "block_size": 8, "mode": "sample", "temperature": 0.8, "top_p": 0.9},
    {"threshold": 0.3, "block_size": 4, "completion_drafts": None},  # speculative completion, drafts dropped
]


@pytest.mark.parametrize("kv_reuse", [True, False])
@pytest.mark.parametrize("case", range(len(STATIC_CASES)))
def test_cuda_graphs_decode_as_without(tokenizer, recording, case, kv_reuse):
    """With cuda_graphs every forward runs through the static steps (the context's K/V regrouped in
    place, a slot's queries masked from other slots' cached keys; recomputation as one step from an
    empty cache) and decodes what the dynamic steps decode: the same tokens, forwards and stats, with
    the static cache holding the reference K/V; no step width beyond those prepared before the first."""
    model = converted_model(tokenizer, seed=case)
    cfg = {**STATIC_CASES[case], "kv_reuse": kv_reuse}
    for prompt in PROMPTS:
        expected = decode(model, tokenizer, prompt, **cfg)
        pool = refusion_module.StepsPool._static
        before = set(pool[model]._steps) if model in pool else set()
        got = decode(model, tokenizer, prompt, cuda_graphs=True, **cfg)
        assert got.tokens == expected.tokens and got.forwards == expected.forwards, (case, prompt)
        assert got.stats == expected.stats
        ctx = recording[-1]
        assert isinstance(ctx.steps, refusion_module.StaticSteps)
        if kv_reuse:
            assert_cache_matches_reference(model, ctx)
        decoder = ReFusionDecoder(ReFusionDecoderConfig(**{"max_new_tokens": 24, **cfg}), tokenizer)
        widest = decoder._widest_step(len(prompt), 24, cfg.get("block_size") or 24)
        assert set(pool[model]._steps) == before | {step_width(q) for q in range(1, widest + 1)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_and_decode_as_eager_on_cuda(tokenizer):
    """On CUDA the static steps are captured graphs; ReFusion still decodes as eagerly (fp32)."""
    model = converted_model(tokenizer).to("cuda")
    for case in (STATIC_CASES[1], STATIC_CASES[2], STATIC_CASES[3]):
        for kv_reuse in (True, False):
            for prompt in PROMPTS:
                expected = decode(model, tokenizer, prompt, kv_reuse=kv_reuse, **case)
                got = decode(model, tokenizer, prompt, kv_reuse=kv_reuse, cuda_graphs=True, **case)
                assert got.tokens == expected.tokens and got.forwards == expected.forwards, (case, prompt)
    assert all(step.graph is not None for step in refusion_module.StepsPool._static[model]._steps.values())
