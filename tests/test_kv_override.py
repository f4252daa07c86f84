"""KV-override attention (COVER): the correction against an explicit second attention pass (every
query row gets its own K/V memory, plain softmax over explicit scores), for shift 0 and 1, the cache
seen by the other queries (the paper) or by the verifying rows only (the mirror), grouped-query
attention, a block mask, padding and a query range shorter than the keys; the same for peaked
attention (score spread up to 16, a planted attention sink, the failing cases of issue 36 as
literal examples) in fp32 and bf16; a cache equal to the current K/V changes nothing; a whole model
runs under it and is restored afterwards, and a COVER decode of a model with peaked attention stays
finite in every layer and matches the explicit reference decode."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.masks.core import additive_mask
from pardec.models.kv_override import KV_OVERRIDE, OTHERS, VERIFIERS, KVOverrideStep, kv_override_attention, register
from tests.conftest import tiny_model
from tests.test_cover_decoder import B, L, cover, reference_cover
from tests.test_mdm_decoders import PROMPTS, mdm_model


class Layer(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx


def explicit_two_pass(q, k, v, cached_k, cached_v, seeds, mask, shift, scale, cached_for=OTHERS):
    """Every query row with its own K/V memory: OTHERS, the override memory (seed columns from the
    cache), except that the row verifying seed i (row i - shift) sees column i from the current K/V;
    VERIFIERS, the current K/V except that the verifying row sees column i from the cache. Plain
    softmax over explicit scores, in float64. Returns ``(out [b, h, q, d], probabilities [b, h, q, kv])``."""
    b, h, q_len, _ = q.shape
    h_kv, kv_len = k.shape[1], k.shape[2]
    offset = kv_len - q_len
    sees_cache = torch.zeros(b, q_len, kv_len, dtype=torch.bool)  # [b, q, kv]: row r reads column j from the cache
    for bi in range(b):
        for r in range(q_len):
            for j in range(kv_len):
                verifying = j - shift - offset == r
                sees_cache[bi, r, j] = bool(seeds[bi, j]) and verifying == (cached_for == VERIFIERS)
    where = sees_cache[:, None, :, :, None]  # [b, 1, q, kv, 1]
    keys = torch.where(where, cached_k.double()[:, :, None], k.double()[:, :, None])  # [b, h_kv, q, kv, d]
    values = torch.where(where, cached_v.double()[:, :, None], v.double()[:, :, None])  # [b, h_kv, q, kv, d]
    keys, values = keys.repeat_interleave(h // h_kv, 1), values.repeat_interleave(h // h_kv, 1)  # [b, h, q, kv, d]
    scores = torch.einsum("bhqd,bhqkd->bhqk", q.double(), keys) * scale  # [b, h, q, kv]
    if mask is not None:
        scores = scores + mask.double()
    probs = torch.softmax(scores, -1)
    return torch.einsum("bhqk,bhqkd->bhqd", probs, values), probs


def block_mask(b: int, q_len: int, kv_len: int, block: int, pad: list[int]) -> torch.Tensor:
    """Block-causal by block index, with the last ``pad[b]`` keys of row b padded out."""

    def rule(bb, hh, qi, kj):
        visible = (kj // block) <= (qi // block)
        lengths = torch.tensor([kv_len - p for p in pad])
        return visible & (kj < lengths[bb])

    return additive_mask(rule, b, q_len, kv_len, torch.float32, kv_cache_len=kv_len - q_len)


def test_the_correction_sits_on_the_shifted_row():
    """With shift 1 the row before a seed is the one that must not see its cached K/V; the seed's
    own row (shift 0's verifier) then sees the cache like every other query."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    cached = (torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    seeds = torch.tensor([[False, False, False, True, False, False]])
    outputs = {}
    for shift in (0, 1):
        step = KVOverrideStep(seeds=seeds, cached={0: cached}, shift=shift)
        outputs[shift], _ = kv_override_attention(Layer(), q, k, v, None, kv_override=step)
    plain_override, _ = kv_override_attention(Layer(), q, k, v, None, kv_override=KVOverrideStep(
        seeds=seeds, cached={0: cached}, shift=99))  # no row verifies: pure override
    for shift, (verifying, other) in {0: (3, 2), 1: (2, 3)}.items():
        assert not torch.allclose(outputs[shift][0, verifying], plain_override[0, verifying])
        assert torch.allclose(outputs[shift][0, other], plain_override[0, other])


@pytest.mark.parametrize("cached_for", [OTHERS, VERIFIERS])
def test_a_cache_equal_to_the_current_kv_changes_nothing(cached_for):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    seeds = torch.rand(2, 7) > 0.5
    mask = block_mask(2, 7, 7, block=2, pad=[2, 0])
    same = KVOverrideStep(seeds=seeds, cached={0: (k, v)}, shift=1, cached_for=cached_for)
    out, _ = kv_override_attention(Layer(), q, k, v, mask, kv_override=same)
    plain, _ = kv_override_attention(Layer(), q, k, v, mask)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(plain, reference.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [7, 4])
@pytest.mark.parametrize("cached_for", [OTHERS, VERIFIERS])
def test_no_seed_computes_the_plain_attention_bit_for_bit(cached_for, q_len):
    """All-false seeds with any cache (COVER's static forwards run the override in every forward): the
    output and the kept probabilities are exactly the plain attention's, not merely close."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, q_len, 64) * 3, torch.randn(2, 2, 7, 64), torch.randn(2, 2, 7, 64)
    cached = (torch.randn(2, 2, 7, 64) * 5, torch.randn(2, 2, 7, 64))
    mask = block_mask(2, q_len, 7, block=2, pad=[2, 0])
    none = KVOverrideStep(seeds=torch.zeros(2, 7, dtype=torch.bool), cached={0: cached}, shift=1,
                          cached_for=cached_for, attention_layer=0)
    plain_step = KVOverrideStep(attention_layer=0)
    out, _ = kv_override_attention(Layer(), q, k, v, mask, kv_override=none)
    plain, _ = kv_override_attention(Layer(), q, k, v, mask, kv_override=plain_step)
    assert torch.equal(out, plain) and torch.equal(none.attention, plain_step.attention)


def test_a_model_runs_under_the_override_and_is_restored():
    register()
    model = tiny_model(24)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    bidirectional = torch.zeros(1, 1, 6, 6)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=bidirectional).logits
        model.set_attn_implementation(KV_OVERRIDE)
        first = KVOverrideStep()
        plain = model(input_ids=ids, attention_mask=bidirectional, kv_override=first).logits
        assert sorted(first.recorded) == [0, 1]  # every layer ran the override function
        seeds = torch.tensor([[False, False, True, False, True, False]])
        masked_ids = ids.clone()
        masked_ids[seeds] = 23
        step = KVOverrideStep(seeds=seeds, cached=first.recorded, shift=1, attention_layer=1)
        verified = model(input_ids=masked_ids, attention_mask=bidirectional, kv_override=step).logits
        model.set_attn_implementation("sdpa")
        after = model(input_ids=ids, attention_mask=bidirectional).logits
    torch.testing.assert_close(plain, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert not torch.allclose(verified, before) and step.attention.shape == (1, 6, 6)


# -- peaked attention (issue 36): exact and finite for any scores ----------------------------------


def column(values: list[float]) -> torch.Tensor:
    """One batch row, one head, head size 1: ``[1, 1, n, 1]``."""
    return torch.tensor(values, dtype=torch.float32)[None, None, :, None]


HIDDEN = torch.finfo(torch.float32).min
# (q, k, cached k, v, cached v, seed column, shift, additive mask [q, kv] or None, verifying row's two-pass output:
# its softmax written out): one head of size 1, scale 1, the paper's mode (the other rows see the cached K/V).
ISSUE_CASES = {
    # delta = -40, the seed column's weight under the override 1 - 2e-9 (1 in fp32): the closed form's ratio is 0.
    "cancellation": ([1, 1], [-20, 0], [20, 0], [1, 2], [3, 2], 0, 0, None, (math.exp(-20) + 2) / (math.exp(-20) + 1)),
    # delta = -16: finite but wrong (0.0).
    "near cancellation": ([1, 1], [4, 0], [20, 0], [1, 2], [3, 2], 0, 0, None, (math.exp(4) + 2) / (math.exp(4) + 1)),
    # delta = 90: exp(delta) overflows fp32.
    "overflow": ([1, 1], [90, 0], [0, 0], [1, 2], [3, 2], 0, 0, None, (math.exp(90) + 2) / (math.exp(90) + 1)),
    # shift 1, block-causal by position: row 0 verifies column 1 but may not see it; delta = 95, alpha = 0.
    "hidden seed column": ([1, 1], [0, 95], [0, 0], [1, 2], [3, 5], 1, 1, [[0, HIDDEN], [0, 0]], 1.0),
}


@pytest.mark.parametrize("case", sorted(ISSUE_CASES))
def test_issue_36_cases_match_the_two_pass_result(case):
    q, k, cached_k, v, cached_v, seed, shift, mask, expected = ISSUE_CASES[case]
    q, k, cached_k, v, cached_v = map(column, (q, k, cached_k, v, cached_v))
    seeds = torch.zeros(1, k.shape[2], dtype=torch.bool)
    seeds[0, seed] = True
    mask = None if mask is None else torch.tensor(mask, dtype=torch.float32)[None, None]
    step = KVOverrideStep(seeds=seeds, cached={0: (cached_k, cached_v)}, shift=shift, attention_layer=0)
    out, _ = kv_override_attention(Layer(), q, k, v, mask, scaling=1.0, kv_override=step)  # [1, q, 1, 1]
    reference, probs = explicit_two_pass(q, k, v, cached_k, cached_v, seeds, mask, shift, 1.0)
    assert reference[0, 0, seed - shift, 0].item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(out.transpose(1, 2).double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.attention.double(), probs.mean(1), atol=1e-6, rtol=1e-5)


SINK = 30.0  # a planted attention sink: one key's logit this much above the rest


def peaked_inputs(std: float, sink: str | None, q_len: int, dtype: torch.dtype, seed: int):
    """q, k, v, cached k, v ([b, h, q|kv, d], grouped: 2 heads per K/V head) with scores of standard
    deviation ``std`` and, ``sink``: "seed", the cached key of one seed column per batch row (5 and 4)
    or "other", the key of the non-seed column 1 in both memories, a logit SINK above the rest for
    every query (dimension 0 of every query is 1, of the sink key SINK / scale, of the other keys 0)."""
    torch.manual_seed(seed)
    b, h, h_kv, kv_len, d = 2, 4, 2, 10, 8
    scale = d**-0.5
    q = torch.randn(b, h, q_len, d) * std
    k, v = torch.randn(b, h_kv, kv_len, d), torch.randn(b, h_kv, kv_len, d)
    cached_k, cached_v = torch.randn(b, h_kv, kv_len, d), torch.randn(b, h_kv, kv_len, d)
    if sink is not None:
        q[..., 0] = 1.0
        k[..., 0] = cached_k[..., 0] = 0.0
        if sink == "seed":
            cached_k[0, :, 5, 0] = cached_k[1, :, 4, 0] = SINK / scale
        else:
            k[:, :, 1, 0] = cached_k[:, :, 1, 0] = SINK / scale
    return [t.to(dtype) for t in (q, k, v, cached_k, cached_v)], scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", [None, "seed", "other"])
@pytest.mark.parametrize("std", [1, 4, 8, 16])
@pytest.mark.parametrize("cached_for", [OTHERS, VERIFIERS])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("masked,q_len", [(False, 10), (True, 10), (True, 6)])
def test_the_override_equals_an_explicit_second_pass(masked, q_len, shift, cached_for, std, sink, dtype):
    """Mild (std 1) to peaked scores, with and without a sink. Seeds 5, 7, 9 and 4, 8; with the block
    mask (blocks of 3, row 1 padded by one key) shift 1 hides seed 9 from its verifying row 8. fp32
    to 1e-5; bf16 inputs (computed in fp32) to the bf16 rounding of the output, 2^-8 relative."""
    (q, k, v, cached_k, cached_v), scale = peaked_inputs(std, sink, q_len, dtype, seed=std + 100 * shift)
    b, kv_len = k.shape[0], k.shape[2]
    seeds = torch.zeros(b, kv_len, dtype=torch.bool)
    seeds[0, [5, 7, 9]] = True
    seeds[1, [4, 8]] = True
    mask = block_mask(b, q_len, kv_len, block=3, pad=[0, 1]) if masked else None
    step = KVOverrideStep(seeds=seeds, cached={0: (cached_k, cached_v)}, shift=shift, attention_layer=0,
                          cached_for=cached_for)
    out, _ = kv_override_attention(Layer(), q, k, v, mask, scaling=scale, kv_override=step)  # [b, q, h, d]
    reference, probs = explicit_two_pass(q, k, v, cached_k, cached_v, seeds, mask, shift, scale, cached_for)
    assert out.dtype == dtype and bool(torch.isfinite(out).all()) and bool(torch.isfinite(step.attention).all())
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 2**-8}
    torch.testing.assert_close(out.transpose(1, 2).double(), reference, **tol)
    torch.testing.assert_close(step.attention.double(), probs.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.attention.sum(-1), torch.ones(b, q_len), atol=1e-5, rtol=0)
    assert torch.equal(step.recorded[0][0], k) and torch.equal(step.recorded[0][1], v)


PEAK = 5.0  # q_norm and k_norm weights times this: scores about PEAK^2 = 25 times their size


def peaked_mdm(attention: str):
    """The COVER tests' tiny MDM with sharply peaked attention. Qwen3 normalises each query and key
    head (q_norm, k_norm) after its projection, so the scale goes on those weights."""
    model = mdm_model(attention, block=B)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(PEAK)
            layer.self_attn.k_norm.weight.mul_(PEAK)
    return model


@pytest.mark.parametrize("seed_input", ["mask", "token"])
@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_a_cover_decode_with_peaked_attention_stays_finite_and_matches_the_reference(attention, seed_input):
    """Every layer's output of every COVER forward is finite, some seeds are verified, and each decode
    gives the tokens, forwards and revisions of the reference decode whose override is an explicit
    second pass per row (no closed form)."""
    model = peaked_mdm(attention)
    cfg = {"draft_threshold": 0.8, "seed_input": seed_input}
    finite = []
    hooks = [layer.register_forward_hook(lambda module, args, out: finite.append(bool(torch.isfinite(out[0]).all())))
             for layer in model.model.layers]
    try:
        results = [cover(cfg, model, prompt, eos=-1)[0] for prompt in PROMPTS]
    finally:
        for hook in hooks:
            hook.remove()
    assert finite and all(finite) and sum(r.stats["seeds"] for r in results) > 0
    for prompt, result in zip(PROMPTS, results):
        tokens, forwards, events = reference_cover(model, prompt, L, B, 0.8, 15, 5, attention, B, eos=-1,
                                                   override=True, seed_input=seed_input)
        assert (result.tokens, result.forwards, result.stats["revisions"]) == (tokens, forwards, events), prompt


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's values on the host (a device sync on a GPU)."""

    SYNCING = {"aten::nonzero", "aten::_local_scalar_dense"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in self.SYNCING
        return func(*args, **(kwargs or {}))


def test_the_override_never_reads_the_seeds_on_the_host():
    """``any``/``nonzero`` on the seeds stall a GPU's launches and cannot be captured in a CUDA graph: a
    forward of 2 or 6 layers under the override syncs as often as the plain forward of the same input,
    and the override still acts in every model (its logits differ from the same masked input's forward
    without one)."""
    register()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    bidirectional = torch.zeros(1, 1, 6, 6)
    seeds = torch.tensor([[False, False, True, False, True, False]])
    syncs = {}
    for layers in (2, 6):
        model = tiny_model(24, num_hidden_layers=layers)
        model.set_attn_implementation(KV_OVERRIDE)
        with torch.no_grad():
            first = KVOverrideStep()
            model(input_ids=ids, attention_mask=bidirectional, kv_override=first)
            masked_ids = ids.masked_fill(seeds, 23)
            plain = model(input_ids=masked_ids, attention_mask=bidirectional, kv_override=KVOverrideStep()).logits
            with HostSyncs() as plain_counter:
                model(input_ids=masked_ids, attention_mask=bidirectional, kv_override=KVOverrideStep())
            step = KVOverrideStep(seeds=seeds, cached=first.recorded, shift=1)
            with HostSyncs() as counter:
                verified = model(input_ids=masked_ids, attention_mask=bidirectional, kv_override=step).logits
        syncs[layers] = (counter.count, plain_counter.count)
        assert not torch.allclose(verified, plain)
    assert syncs[2][0] == syncs[2][1] and syncs[6][0] == syncs[6][1], syncs
