"""Jacobi and multi-block (rejection recycling) decoders: lossless vs AR greedy, no-cache reference,
exact counts on constructed models, the multi-block mask, promotion, pool, configs."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import DynamicCache, Qwen3Config

from pardec.common.errors import ConfigError
from pardec.common.kv_cache import CACHE_KEYWORD
from pardec.inference.decoders import multiblock
from pardec.inference.decoders.decode_steps import DynamicSteps, StaticSteps
from pardec.inference.decoders.jacobi import init_draft
from pardec.inference.decoders.multiblock import Block, BlockChain, Commit, NgramPool, forward_branches
from pardec.inference.decoders.registry import build_decoder, decoder_config
from pardec.masks.core import additive_mask
from tests.conftest import tiny_model

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
NO_EOS: set[int] = set()
MAX_NEW = 19  # aligned with none of the block sizes below
RECIPES = Path(__file__).resolve().parents[1] / "pardec" / "recipes" / "decoder"


def decode(cfg: dict, model, prompt, eos=NO_EOS, seed=0, max_new=MAX_NEW):
    return build_decoder({"max_new_tokens": max_new, **cfg}, tokenizer=None).decode(model, [prompt], eos, [seed])[0]


def ar_tokens(model, prompt, eos=NO_EOS, max_new=MAX_NEW) -> list[int]:
    return decode({"name": "ar"}, model, prompt, eos, max_new=max_new).tokens


DECODERS = [
    {"name": "jacobi", "block_size": 1},
    {"name": "jacobi", "block_size": 3},
    {"name": "jacobi", "block_size": 4, "draft_init": "repeat"},
    {"name": "jacobi", "block_size": 8},
    {"name": "multiblock", "block_size": 4, "num_blocks": 1, "ngram_pool_size": 0},
    {"name": "multiblock", "block_size": 4, "num_blocks": 2, "spawn_ratio": 0.5},
    {"name": "multiblock", "block_size": 3, "num_blocks": 3, "spawn_ratio": 0.25, "verification_size": 2},
    {"name": "multiblock", "block_size": 5, "num_blocks": 2, "spawn_ratio": 0.85, "ngram_pool_size": 8,
     "verification_size": 6, "draft_init": "repeat"},
    {"name": "multiblock", "block_size": 1, "num_blocks": 4, "spawn_ratio": 1.0},
]


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("cfg", DECODERS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_greedy_lossless_vs_ar_and_counters(arch, cfg):
    model = tiny_model(30, arch, seed=1)
    k = cfg.get("num_blocks", 1) * cfg["block_size"]  # most tokens one forward can commit
    for i, prompt in enumerate(PROMPTS):
        result = decode(cfg, model, prompt, seed=i)
        assert result.tokens == ar_tokens(model, prompt), (cfg, prompt)
        assert result.committed == len(result.tokens) == MAX_NEW and not result.hit_eos
        assert math.ceil(result.committed / k) <= result.forwards <= result.committed
        assert result.wall_time_s > 0


@pytest.mark.parametrize("cfg", DECODERS[1:3] + DECODERS[5:8], ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_eos_inside_a_block(cfg):
    model = tiny_model(30, seed=2)
    for i, prompt in enumerate(PROMPTS):
        free = ar_tokens(model, prompt)
        for k in (2, 5):  # EOS = the AR output's k-th token: it lands inside a block
            eos = {free[k - 1]}
            reference = ar_tokens(model, prompt, eos)
            result = decode(cfg, model, prompt, eos, seed=i)
            assert result.tokens == reference and result.tokens[-1] in eos and result.hit_eos
            assert len(result.tokens) <= k and result.committed == len(result.tokens)
            assert result.forwards <= result.committed


def test_recycled_candidates_are_exercised_and_lossless():
    model = tiny_model(30, seed=1)  # tiny random models loop, so rejected n-grams come back
    cfg = {"name": "multiblock", "block_size": 5, "num_blocks": 2, "spawn_ratio": 0.5, "ngram_pool_size": 8,
           "verification_size": 4}
    stats = []
    for i, prompt in enumerate(PROMPTS):
        result = decode(cfg, model, prompt, seed=i, max_new=40)
        assert result.tokens == ar_tokens(model, prompt, max_new=40)
        stats.append(result.stats)
    assert sum(s["candidates_verified"] for s in stats) > 0
    assert sum(s["recycled_wins"] for s in stats) > 0 and sum(s["recycled_extra_tokens"] for s in stats) > 0
    assert sum(s["promotions"] for s in stats) > 0 and sum(s["promoted_pseudo_accepted"] for s in stats) > 0


# --------------------------------------------------------------------------- no-cache reference


def jacobi_no_cache(model, prompt, block_size, draft_init, seed, max_new, eos=NO_EOS):
    """Jacobi decoding re-running the whole sequence every iteration (no KV cache)."""
    rng = random.Random(seed)
    tokens, draft, forwards = [], [], 0
    while len(tokens) < max_new:
        if not draft:
            context = list(prompt) + tokens
            draft = init_draft(draft_init, rng, context, context[-1], min(block_size, max_new - len(tokens)))
        seq = list(prompt) + tokens + draft[:-1]  # the last len(draft) inputs: [anchor, y_1 .. y_{w-1}]
        with torch.no_grad():
            pred = model(torch.tensor([seq])).logits[0, -len(draft) :].argmax(-1).tolist()
        forwards += 1
        agreed = next((i for i, (d, p) in enumerate(zip(draft, pred)) if d != p), len(draft))
        accepted = min(agreed + 1, len(draft))
        for tok in pred[:accepted]:
            tokens.append(tok)
            if tok in eos:
                return tokens, forwards
        draft = pred[accepted:]
    return tokens, forwards


@pytest.mark.parametrize("draft_init", ["context", "repeat"])
@pytest.mark.parametrize("block_size", [2, 5])
def test_kv_cached_jacobi_equals_no_cache_recomputation(draft_init, block_size):
    model = tiny_model(30, "llama", seed=3)
    for i, prompt in enumerate(PROMPTS):
        result = decode({"name": "jacobi", "block_size": block_size, "draft_init": draft_init}, model, prompt, seed=i)
        tokens, forwards = jacobi_no_cache(model, prompt, block_size, draft_init, i, MAX_NEW)
        assert (result.tokens, result.forwards) == (tokens, forwards)


@pytest.mark.parametrize("draft_init", ["context", "repeat"])
@pytest.mark.parametrize("block_size", [1, 3, 6])
def test_multiblock_with_one_block_and_no_pool_is_jacobi(draft_init, block_size):
    model = tiny_model(30, seed=4)
    for i, prompt in enumerate(PROMPTS):
        jacobi = decode({"name": "jacobi", "block_size": block_size, "draft_init": draft_init}, model, prompt, seed=i)
        single = decode({"name": "multiblock", "block_size": block_size, "num_blocks": 1, "ngram_pool_size": 0,
                         "draft_init": draft_init}, model, prompt, seed=i)
        assert (single.tokens, single.forwards) == (jacobi.tokens, jacobi.forwards)
        assert single.stats["spawned"] == single.stats["candidates_verified"] == 0


# --------------------------------------------------------------------------- constructed models


class RuleLM(torch.nn.Module):
    """A "model" whose greedy next token is ``rule(input token, next position)``: one-hot logits.

    It writes one KV entry per input (key = position id, value = token) and asserts that the cache
    it is handed holds exactly positions ``0 .. first input position - 1`` in order, i.e. that the
    decoder keeps only the committed tokens (minus the anchor) between forwards.
    """

    def __init__(self, vocab_size: int, rule):
        super().__init__()
        self.config = Qwen3Config(vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, head_dim=8)
        self.config._attn_implementation = "eager"
        self.rule = rule
        self.weight = torch.nn.Parameter(torch.zeros(1))  # device / dtype probe only

    @property
    def dtype(self) -> torch.dtype:  # as a PreTrainedModel has (the decoders build masks in it)
        return self.weight.dtype

    def forward(self, input_ids, position_ids, attention_mask=None, use_cache=True, logits_to_keep=0, **kwargs):
        cache = kwargs[CACHE_KEYWORD]
        cached = cache.get_seq_length()
        first = int(position_ids[0, 0])
        assert cached == first, f"cache holds {cached} entries, first input at position {first}"
        if cached:
            keys = cache.layers[0].keys[0, 0, :, 0]
            assert keys.tolist() == list(range(cached)), "cache entries out of order"
        cache.update(position_ids.float()[:, None, :, None], input_ids.float()[:, None, :, None], 0)
        nxt = [self.rule(t, p + 1) for t, p in zip(input_ids[0].tolist(), position_ids[0].tolist())]
        logits = F.one_hot(torch.tensor([nxt]), self.config.vocab_size).float()  # [1, q, V]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


V = 64
PROMPT = [40, 41, 42]  # positions 0..2; generated positions start at 3


def test_tpf_reaches_block_size_when_drafts_are_the_fixed_point():
    copy = RuleLM(V, lambda token, position: token)  # greedy next token = the previous token
    for n, max_new in [(4, 10), (4, 12), (5, 5), (1, 3)]:
        for cfg in ({"name": "jacobi"}, {"name": "multiblock", "num_blocks": 2, "spawn_ratio": 0.25}):
            result = decode({**cfg, "block_size": n, "draft_init": "repeat"}, copy, PROMPT, max_new=max_new)
            assert result.tokens == [42] * max_new
            assert result.forwards == math.ceil(max_new / n)  # every block converges in its first forward
            assert result.committed / result.forwards == max_new / math.ceil(max_new / n)


def test_exact_counts_on_a_position_model():
    """Next token = its position (context-free): a fresh draft costs one forward per block, after
    which every in-flight draft is the fixed point."""
    model = RuleLM(V, lambda token, position: position % V)
    jacobi = decode({"name": "jacobi", "block_size": 4, "draft_init": "repeat"}, model, PROMPT, max_new=10)
    assert jacobi.tokens == list(range(3, 13))
    assert jacobi.forwards == 6  # blocks of 4, 4, 2 positions: (1 + 3), (1 + 3), (1 + 1)
    multi = decode({"name": "multiblock", "block_size": 4, "num_blocks": 2, "spawn_ratio": 0.25,
                    "draft_init": "repeat"}, model, PROMPT, max_new=10)
    assert multi.tokens == list(range(3, 13))
    # 1 (fresh RA) + 4 (RA rest + first token of the spawned block) + 4 + 1 (last position)
    assert multi.forwards == 4
    assert multi.stats["spawned"] == 2 and multi.stats["promotions"] == 2


def markov_then_position(token: int, position: int) -> int:
    """Positions 4..6 follow the previous token (+1): they converge one per forward, left to right;
    every other position is context-free (its position) and converges in one forward."""
    return (token + 1) % V if position in (4, 5, 6) else position % V


def test_promotion_keeps_pseudo_active_progress(monkeypatch):
    """RA = positions 3..6 (3 followed by a Markov run), pseudo-active block = 7..10 (context-free).
    The pseudo-active block is fully pseudo-accepted while the RA is still converging; when the RA
    ends with a mismatch at its last position, the promoted block keeps its drafts and commits all
    4 tokens in the next forward. Discarding them (the reference) costs one more forward."""
    model = RuleLM(V, markov_then_position)
    cfg = {"name": "multiblock", "block_size": 4, "num_blocks": 2, "spawn_ratio": 0.25, "draft_init": "repeat"}
    expected = [3, 4, 5, 6, 7, 8, 9, 10]
    kept = decode(cfg, model, PROMPT, max_new=8)
    assert kept.tokens == expected
    assert kept.forwards == 5 and kept.stats["promotions"] == 1 and kept.stats["promoted_pseudo_accepted"] == 4

    advance = BlockChain.advance

    def discarding_advance(self, commit, chain_preds):  # the reference: re-draft the promoted block
        carried = advance(self, commit, chain_preds)
        if carried >= 0:
            self.draft = [commit.preds[commit.count - 1]] * len(self.draft)
        return carried

    monkeypatch.setattr(multiblock.BlockChain, "advance", discarding_advance)
    discarded = decode(cfg, model, PROMPT, max_new=8)
    assert discarded.tokens == expected and discarded.forwards == 6 > kept.forwards


def test_promotion_state_keeps_the_pseudo_active_draft():
    state = BlockChain(position=10, block_size=4, budget_end=100)
    state.blocks = [Block(8, 12, 8), Block(12, 16, 16)]  # RA at 10..11; pseudo-active fully pseudo-accepted
    state.draft = [20, 21, 30, 31, 32, 33]  # positions 10..15
    chain_preds = [20, 99, 50, 51, 52, 53]  # 10 agrees, 11 disagrees: commit 20, 99
    carried = state.advance(Commit(2, -1, chain_preds, chain_agreed=1, chain_count=2), chain_preds)
    assert carried == 4
    assert state.position == 12 and state.blocks == [Block(12, 16, 16)]
    assert state.draft == [30, 31, 32, 33]  # kept, neither re-initialised nor replaced by chain_preds
    assert state.inputs() == [30, 31, 32]  # what the next forward verifies


def test_pseudo_active_update_freezes_the_agreeing_run_plus_one():
    state = BlockChain(position=0, block_size=4, budget_end=100)
    state.blocks = [Block(0, 4, 0), Block(4, 8, 5)]  # pseudo-active: position 4 already pseudo-accepted
    state.draft = [1, 2, 3, 4, 70, 71, 72, 73]
    chain_preds = [1, 9, 9, 9, 80, 71, 90, 91]  # commit 1, 9; pseudo: 5 agrees, 6 disagrees
    carried = state.advance(Commit(2, -1, chain_preds, chain_agreed=1, chain_count=2), chain_preds)
    assert carried == -1 and state.position == 2
    assert state.blocks[1].frozen_until == 7  # 5 (agreeing) + 6 (the "+1")
    assert state.draft == [9, 9, 70, 71, 90, 91]  # RA: Jacobi update; 4 kept frozen; 5.. from chain_preds


# --------------------------------------------------------------------------- mask, cache, pool


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("static", [False, True])
def test_one_forward_over_chain_and_candidates_matches_separate_forwards(attn, static):
    """Over a DynamicCache and over the static cache the CUDA graphs replay (run eagerly here)."""
    model = tiny_model(30, seed=5)
    model.set_attn_implementation(attn)
    prompt, anchor, chain = [3, 4, 5, 6], 7, [8, 9, 10, 11, 12]
    candidates = [[13, 14, 15], [8, 16, 17]]
    steps = StaticSteps(model, 64, graphs=False) if static else DynamicSteps(model)
    steps.reset(prompt)  # the anchor is the first input
    with torch.no_grad():
        preds = forward_branches(model, steps, anchor, len(prompt) + 1, chain, candidates)
    assert steps.length == len(prompt) + 1 + len(chain) + sum(map(len, candidates))

    def separate(tokens):  # plain causal forward without cache over prompt + anchor + tokens
        with torch.no_grad():
            return model(torch.tensor([prompt + [anchor] + tokens])).logits[0, -len(tokens) - 1 :].argmax(-1).tolist()

    assert preds.chain == separate(chain)
    assert preds.candidates == [separate(c) for c in candidates]
    assert preds.offsets == [1 + len(chain), 1 + len(chain) + len(candidates[0])]


def test_multiblock_mask_predicate():
    # cache of 2 | anchor (pos 2) | chain at 3, 4 | candidate at 3, 4
    branch = torch.tensor([[0, 1, 1, 2, 2]])
    positions = torch.tensor([[2, 3, 4, 3, 4]])
    predicate = multiblock.multiblock_mask(branch, positions, cache_len=2)
    mask = additive_mask(predicate, 1, 5, 7, torch.float32, kv_cache_len=2)[0, 0]  # [q, cache + q]
    allowed = (mask == 0).int().tolist()
    assert allowed == [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1],
    ]
    assert mask.min() == torch.finfo(torch.float32).min


def test_keep_moves_a_branch_next_to_the_anchor():
    steps = DynamicSteps(tiny_model(30))
    steps.cache = DynamicCache()
    ids = torch.arange(10, dtype=torch.float32)[None, None, :, None]  # [1, 1, 10, 1]
    steps.cache.update(ids, ids + 100, 0)
    steps.keep(base=4, start=7, count=2)
    assert steps.cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 7, 8]
    assert steps.cache.layers[0].values[0, 0, :, 0].tolist() == [100, 101, 102, 103, 107, 108]
    steps.keep(base=3, start=3, count=1)  # contiguous: a crop
    assert steps.length == 4


def test_static_keep_equals_dynamic_keep():
    """The static cache copies the kept keys down in place; the next forward sees what the dynamic
    cache's gather leaves (same logits), and a keep past the committed keys is refused."""
    model = tiny_model(30, seed=2)
    static, dynamic = StaticSteps(model, 32, graphs=False), DynamicSteps(model)
    block = torch.zeros((1, 1, 3, 3))
    with torch.no_grad():
        for steps in (static, dynamic):
            steps.reset([3, 4, 5, 6])
            steps.forward([7, 8, 9, 10, 11, 12], torch.zeros((1, 1, 6, 6)), [0, 1, 2, 1, 2, 3])
            steps.keep(base=5, start=7, count=3)
        assert static.length == dynamic.length == 8
        torch.testing.assert_close(static.forward([13, 14, 15], block, [4, 5, 6]),
                                   dynamic.forward([13, 14, 15], block, [4, 5, 6]))
    with pytest.raises(ValueError, match="keep"):
        static.keep(base=2, start=9, count=5)


def test_ngram_pool_candidates():
    pool = NgramPool(capacity=3)
    pool.push([1])  # too short to ever yield a candidate
    pool.push([5, 7, 8, 9, 7, 1])
    pool.push([2, 7, 3])
    pool.push([7, 4, 4, 4, 4, 4])
    assert len(pool.entries) == 3
    main = [6, 6, 6]
    # newest first; the first 7 of each entry; short continuations completed from main
    assert pool.candidates(7, main, limit=5) == [[4, 4, 4], [3, 6, 6], [8, 9, 7]]
    assert pool.candidates(7, main, limit=2) == [[4, 4, 4], [3, 6, 6]]
    assert pool.candidates(7, [4, 4, 4], limit=5) == [[3, 4, 4], [8, 9, 7]]  # the chain's own draft is skipped
    assert pool.candidates(0, main, limit=5) == [] and pool.candidates(7, [], limit=5) == []
    pool.push([9, 9])
    assert len(pool.entries) == 3 and pool.candidates(7, main, limit=5) == [[4, 4, 4], [3, 6, 6]]


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"name": "jacobi", "block_size": 0}, "decoder.block_size"),
        ({"name": "jacobi", "draft_init": "noise"}, "decoder.draft_init"),
        ({"name": "jacobi", "max_iterations": 3}, "decoder.max_iterations"),
        ({"name": "multiblock", "num_blocks": 0}, "decoder.num_blocks"),
        ({"name": "multiblock", "spawn_ratio": 0.0}, "decoder.spawn_ratio"),
        ({"name": "multiblock", "spawn_ratio": 1.5}, "decoder.spawn_ratio"),
        ({"name": "multiblock", "ngram_pool_size": -1}, "decoder.ngram_pool_size"),
        ({"name": "multiblock", "verification_size": -2}, "decoder.verification_size"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        build_decoder(overrides, tokenizer=None)


@pytest.mark.parametrize("name", ["jacobi", "multiblock"])
def test_recipes_validate(name):
    path = RECIPES / f"{name}.yaml"
    assert path.read_text().startswith("# python -m pardec.cli.validate checkpoint=<dir> decoder=")
    cfg = decoder_config(OmegaConf.load(path))
    assert cfg.name == name and build_decoder(cfg, tokenizer=None).name == name


def test_multiblock_rejects_backends_without_custom_masks():
    model = RuleLM(V, lambda token, position: token)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="multi-block decoding passes a 4-D float attention mask"):
        decode({"name": "multiblock"}, model, PROMPT)
    with pytest.raises(ValueError, match="empty prompt"):
        decode({"name": "jacobi"}, model, [])
