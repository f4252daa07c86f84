"""Decode steps (pardec.inference.decoders.decode_steps): the static-cache steps that CUDA graphs
replay compute what the eager DynamicCache steps compute, and the AR, ISD, Jacobi and multi-block decoders with
``cuda_graphs`` decode the same tokens as without (on CPU the static steps run eagerly; the graph
capture itself is checked by the CUDA tests)."""

from __future__ import annotations

import pytest
import torch

from pardec.common.errors import ConfigError
from pardec.inference.decoders.decode_steps import (
    BUCKET,
    SMALL,
    DynamicSteps,
    StaticSteps,
    StepsPool,
    causal_block,
    step_width,
)
from pardec.inference.decoders.isd import StepMasks
from pardec.inference.decoders.registry import build_decoder
from tests.test_isd_decoder import MASK, MODELS, NO_EOS, PROMPTS, ar_greedy, isd, random_lm

torch.set_num_threads(1)


def brute_force_block(q: int, visible) -> torch.Tensor:
    """Additive ``[1, 1, q, q]`` from a predicate over (query, key), by a loop."""
    block = torch.full((1, 1, q, q), torch.finfo(torch.float32).min)
    for i in range(q):
        for j in range(q):
            if visible(i, j):
                block[0, 0, i, j] = 0.0
    return block


def test_causal_block_equals_a_loop():
    for q in (1, 2, 5):
        assert torch.equal(causal_block(q, torch.float32, "cpu"), brute_force_block(q, lambda i, j: j <= i))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_steps_equal_dynamic_steps_through_growth_and_crops(arch):
    """The same script of forwards and crops (widths 1, 4 and 7, ISD's and a plain causal mask)
    gives the same logits over a StaticCache as over a DynamicCache."""
    model = random_lm(arch)
    masks = StepMasks(model.dtype, "cpu")
    dynamic, static = DynamicSteps(model), StaticSteps(model, max_len=64, graphs=False)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, MASK, (n,), generator=g).tolist()  # noqa: E731
    context = rand(9)
    dynamic.reset(context)
    static.reset(context)
    script = [(1, 0, None), (1, 3, 2), (4, 3, 4), (4, 3, 1), (1, 0, 0), (2, 0, 1), (1, 3, 0)]
    for n_clean, n_masks, keep in script:  # keep: how many of the step's tokens stay in the cache
        ids = rand(n_clean) + [MASK] * n_masks
        block = causal_block(len(ids), model.dtype, "cpu") if n_masks == 0 else masks.block(n_clean, n_masks)
        assert static.length == dynamic.length
        before = static.length
        expected, got = dynamic.forward(ids, block), static.forward(ids, block)
        assert got.shape == expected.shape == (len(ids), model.config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if keep is not None:
            dynamic.crop(before + keep)
            static.crop(before + keep)
    assert static.length == dynamic.length


def test_step_widths():
    assert [step_width(q) for q in (1, 5, SMALL, SMALL + 1, 2 * SMALL, 2 * SMALL + 1)] == [
        1, 5, SMALL, 2 * SMALL, 2 * SMALL, 3 * SMALL]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_steps_pad_wide_steps_and_equal_dynamic_steps(arch):
    """Steps wider than SMALL run padded to a multiple of it (a random mask over their own keys, shared
    positions as offsets) and give the dynamic steps' logits, also when a stale padded key sits where the
    next step writes; near the cache's end a step that the padding would overflow runs at its own width."""
    model = random_lm(arch)
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, MASK, (n,), generator=g).tolist()  # noqa: E731
    context = rand(5)
    dynamic, static = DynamicSteps(model), StaticSteps(model, max_len=5 + 3 + 9 + 13, graphs=False)
    dynamic.reset(context)
    static.reset(context)
    for q, keep in [(11, 3), (9, None), (13, None)]:  # the last: 5 + 3 + 9 + 16 > 30, so it runs at 13
        visible = torch.rand((q, q), generator=g) < 0.6
        visible |= torch.eye(q, dtype=torch.bool)
        block = torch.zeros((1, 1, q, q)).masked_fill(~visible, torch.finfo(torch.float32).min)
        offsets = [i // 2 for i in range(q)]
        before = static.length
        ids = rand(q)
        expected, got = dynamic.forward(ids, block, offsets), static.forward(ids, block, offsets)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert static.length == dynamic.length == before + q
        if keep is not None:
            dynamic.crop(before + keep)
            static.crop(before + keep)
    assert sorted(static._steps) == [13, 16]


@pytest.mark.parametrize("name", ["jacobi", "multiblock", "isd"])
def test_static_steps_prepare_every_width_before_the_first_decode(name):
    """StepsPool.get prepares (on CUDA: captures) every width the decoder's steps can take, so decoding
    adds none: no graph is captured while a decode is timed."""
    model = MODELS["parrot"]("llama")
    cfg = {"name": name, "max_new_tokens": 24, "cuda_graphs": True, **{
        "jacobi": {"block_size": 12}, "multiblock": {"block_size": 4, "num_blocks": 3, "verification_size": 2,
                                                     "ngram_pool_size": 4, "spawn_ratio": 0.5},
        "isd": {"stride": 4}}[name]}
    decoder = build_decoder(cfg, None)
    widest = {"jacobi": 12, "multiblock": 1 + (3 + 2) * 4, "isd": 8}[name]
    prepared = sorted({step_width(q) for q in range(1, widest + 1)})
    for prompt in PROMPTS:
        decoder.decode_one(model, prompt, NO_EOS, 0)
        assert sorted(StepsPool._static[model]._steps) == prepared, prompt


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["random", "parrot"])
def test_isd_with_cuda_graphs_decodes_as_without(arch, kind):
    """ISD greedy over static steps equals ISD over dynamic steps and AR greedy, token for token,
    with the same forwards; one decoder serves every prompt (its static cache is reused)."""
    model = MODELS[kind](arch)
    for stride in (2, 4):
        static_decoder = isd(stride=stride, cuda_graphs=True)
        for prompt in PROMPTS:
            got = static_decoder.decode_one(model, prompt, NO_EOS, 0)
            expected = isd(stride=stride).decode_one(model, prompt, NO_EOS, 0)
            assert got.tokens == expected.tokens == ar_greedy(model, prompt), (stride, prompt)
            assert got.forwards == expected.forwards and got.stats == expected.stats


def test_isd_with_cuda_graphs_stops_at_eos():
    model = MODELS["parrot"]("qwen3")
    prompt = PROMPTS[0]
    full = ar_greedy(model, prompt)
    eos = {full[5]}
    got = isd(stride=3, cuda_graphs=True).decode_one(model, prompt, eos, 0)
    assert got.tokens == full[: full.index(full[5]) + 1] and got.hit_eos


def jacobi(**overrides):
    return build_decoder({"name": "jacobi", "max_new_tokens": 16, **overrides}, tokenizer=None)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["random", "parrot"])
def test_jacobi_with_cuda_graphs_decodes_as_without(arch, kind):
    """Jacobi over static steps (every block width its own step) equals Jacobi over dynamic steps
    and AR greedy, token for token, with the same forwards; one decoder serves every prompt."""
    model = MODELS[kind](arch)
    for block_size, draft_init in ((3, "context"), (5, "repeat")):
        static_decoder = jacobi(block_size=block_size, draft_init=draft_init, cuda_graphs=True)
        for prompt in PROMPTS:
            got = static_decoder.decode_one(model, prompt, NO_EOS, 7)
            expected = jacobi(block_size=block_size, draft_init=draft_init).decode_one(model, prompt, NO_EOS, 7)
            assert got.tokens == expected.tokens == ar_greedy(model, prompt), (block_size, prompt)
            assert got.forwards == expected.forwards and got.stats == expected.stats


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_multiblock_with_cuda_graphs_decodes_as_without(arch):
    """Multi-block + recycling over static steps (branches sharing positions, the winning branch's
    keys moved down) equals it over dynamic steps and AR greedy, with the same forwards and stats."""
    for kind in ("random", "parrot"):
        model = MODELS[kind](arch)
        for cfg in ({"block_size": 3, "num_blocks": 2}, {"block_size": 4, "num_blocks": 3, "spawn_ratio": 0.5}):
            cfg = {"name": "multiblock", "max_new_tokens": 16, "ngram_pool_size": 4, "verification_size": 2, **cfg}
            static_decoder = build_decoder({**cfg, "cuda_graphs": True}, None)
            for prompt in PROMPTS:
                got = static_decoder.decode_one(model, prompt, NO_EOS, 5)
                expected = build_decoder(cfg, None).decode_one(model, prompt, NO_EOS, 5)
                assert got.tokens == expected.tokens == ar_greedy(model, prompt), (kind, cfg, prompt)
                assert got.forwards == expected.forwards and got.stats == expected.stats


def test_jacobi_with_cuda_graphs_stops_at_eos():
    model = MODELS["parrot"]("llama")
    full = ar_greedy(model, PROMPTS[2])
    got = jacobi(block_size=4, cuda_graphs=True).decode_one(model, PROMPTS[2], {full[6]}, 0)
    assert got.tokens == full[: full.index(full[6]) + 1] and got.hit_eos


@pytest.mark.parametrize("greedy", [True, False])
def test_ar_with_cuda_graphs_decodes_as_without(greedy):
    model = random_lm("llama")
    cfg = {"name": "ar", "max_new_tokens": 12, "greedy": greedy}
    static, dynamic = build_decoder({**cfg, "cuda_graphs": True}, None), build_decoder(cfg, None)
    full = ar_greedy(model, PROMPTS[0], 12)
    for prompt, eos in [(PROMPTS[0], NO_EOS), (PROMPTS[1], NO_EOS), (PROMPTS[0], {full[4]})]:
        got = static.decode(model, [prompt], eos, [3])[0]
        expected = dynamic.decode(model, [prompt], eos, [3])[0]
        assert got.tokens == expected.tokens and got.hit_eos == expected.hit_eos
        assert got.forwards == got.committed == len(got.tokens)


def test_ar_cuda_graphs_refuses_batches():
    with pytest.raises(ConfigError, match="decoder.batch_size"):
        build_decoder({"name": "ar", "batch_size": 4, "cuda_graphs": True}, None)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_steps_with_context_masks_and_selects_equal_dynamic_steps(arch):
    """Steps whose queries see only some cached keys (a random ``context`` mask), at positions before the
    first uncached one (negative offsets), with the cache reordered by ``select`` in between (ReFusion's
    pattern), give the dynamic steps' logits; a later step without a context mask sees every key again."""
    model = random_lm(arch)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, MASK, (n,), generator=g).tolist()  # noqa: E731
    minimum = torch.finfo(torch.float32).min
    dynamic, static = DynamicSteps(model), StaticSteps(model, max_len=64, graphs=False)
    for steps in (dynamic, static):
        steps.reset([5, 6, 7, 8, 9, 10])
    script = [(3, True, None), (10, True, [0, 1, 2, 3, 4, 5, 12, 13, 6, 7]), (4, False, [0, 1, 9, 8, 2, 3]),
              (2, True, None), (9, False, None)]
    for q, with_context, selection in script:
        length = static.length
        context = None
        if with_context:
            visible = torch.rand((q, length), generator=g) < 0.5
            visible[:, 0] = True
            context = torch.zeros((1, 1, q, length)).masked_fill(~visible, minimum)
        block = causal_block(q, model.dtype, "cpu")
        offsets = (torch.randint(-length, q, (q,), generator=g)).tolist()
        ids = rand(q)
        expected = dynamic.forward(ids, block, offsets, context)
        torch.testing.assert_close(static.forward(ids, block, offsets, context), expected, rtol=1e-5, atol=1e-5)
        if selection is not None:
            for steps in (dynamic, static):
                steps.select(selection)
        assert static.length == dynamic.length
    with pytest.raises(ValueError, match="select keys"):
        static.select([0, static.length])


def test_static_steps_refuse_overflow_and_bad_crops():
    model = random_lm("qwen3")
    steps = StaticSteps(model, max_len=8, graphs=False)
    steps.reset([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="overflows the static cache of 8"):
        steps.forward([1, 2, 3, 4], causal_block(4, model.dtype, "cpu"))
    with pytest.raises(ValueError, match="crop to 6 keys"):
        steps.crop(6)


def test_steps_pool_reuses_the_static_cache_until_a_longer_one_is_needed():
    model = random_lm("qwen3")
    assert isinstance(StepsPool(cuda_graphs=False).get(model, 10), DynamicSteps)
    pool = StepsPool(cuda_graphs=True)
    first = pool.get(model, 10)
    assert first.max_len == BUCKET and pool.get(model, BUCKET) is first
    assert StepsPool(cuda_graphs=True).get(model, 10) is first  # shared by the model's decoders
    longer = pool.get(model, BUCKET + 1)
    assert longer is not first and longer.max_len == 2 * BUCKET
    assert pool.get(model, 10) is longer and pool.get(random_lm("qwen3"), 10) is not longer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_equal_eager_static_steps_and_isd_equals_ar_on_cuda():
    """Captured steps replay the eager kernels: the same logits as the eager static step, and ISD,
    Jacobi and multi-block with graphs still reproduce AR greedy (fp32)."""
    model = MODELS["parrot"]("qwen3").to("cuda")
    masks = StepMasks(model.dtype, "cuda")
    eager, graphed = StaticSteps(model, 64, graphs=False), StaticSteps(model, 64, graphs=True)
    for steps in (eager, graphed):
        steps.reset([3, 4, 5, 6])
    for n_clean in (1, 3, 3, 1):
        ids, block = [7] * n_clean + [MASK] * 2, masks.block(n_clean, 2)
        torch.testing.assert_close(graphed.forward(ids, block), eager.forward(ids, block), rtol=0, atol=0)
        for steps in (eager, graphed):
            steps.crop(steps.length - 2)
    for stride in (2, 4):
        for prompt in PROMPTS:
            got = isd(stride=stride, max_new_tokens=40, cuda_graphs=True).decode_one(model, prompt, NO_EOS, 0)
            assert got.tokens == ar_greedy(model, prompt, 40), (stride, prompt)
    for block_size in (3, 8):
        for prompt in PROMPTS:
            got = jacobi(block_size=block_size, max_new_tokens=40,
                         cuda_graphs=True).decode_one(model, prompt, NO_EOS, 0)
            assert got.tokens == ar_greedy(model, prompt, 40), (block_size, prompt)
            multiblock = build_decoder({"name": "multiblock", "block_size": block_size, "max_new_tokens": 40,
                                        "cuda_graphs": True}, None)
            assert multiblock.decode_one(model, prompt, NO_EOS, 0).tokens == ar_greedy(model, prompt, 40)
    assert all(step.graph is not None
               for step in StepsPool._static[model]._steps.values())  # prepared widths are captured
