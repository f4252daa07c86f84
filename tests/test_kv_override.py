"""KV-override attention (COVER): the closed-form correction against an explicit second attention
pass, per query row, for shift 0 and 1, the cache seen by the other queries (the paper) or by the
verifying rows only (the mirror), grouped-query attention, a block mask, padding and a query range
shorter than the keys; a cache equal to the current K/V changes nothing; a whole model runs
under it and is restored afterwards."""

from __future__ import annotations

import pytest
import torch

from pardec.masks.core import additive_mask
from pardec.models.kv_override import KV_OVERRIDE, OTHERS, VERIFIERS, KVOverrideStep, kv_override_attention, register
from tests.conftest import tiny_model


class Layer(torch.nn.Module):
    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx


def explicit_two_pass(q, k, v, cached_k, cached_v, seeds, mask, shift, scale, cached_for=OTHERS):
    """Row by row: OTHERS, the override memory (seed columns from the cache), except that the row
    verifying seed i (row i - shift) sees column i from the current K/V; VERIFIERS, the current K/V
    except that the verifying row sees column i from the cache. Plain softmax attention per row."""
    b, h, q_len, _ = q.shape
    h_kv, kv_len = k.shape[1], k.shape[2]
    rep = h // h_kv
    offset = kv_len - q_len
    out = torch.zeros(b, h, q_len, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for head in range(h):
            g = head // rep
            for r in range(q_len):
                keys, values = k[bi, g].clone().double(), v[bi, g].clone().double()
                for j in range(kv_len):
                    verifying = bool(seeds[bi, j]) and j - shift - offset == r
                    if seeds[bi, j] and verifying == (cached_for == VERIFIERS):
                        keys[j], values[j] = cached_k[bi, g, j].double(), cached_v[bi, g, j].double()
                scores = (keys @ q[bi, head, r].double()) * scale  # [kv]
                if mask is not None:
                    scores = scores + mask[bi, 0, r].double()
                out[bi, head, r] = torch.softmax(scores, -1) @ values
    return out


def block_mask(b: int, q_len: int, kv_len: int, block: int, pad: list[int]) -> torch.Tensor:
    """Block-causal by block index, with the last ``pad[b]`` keys of row b padded out."""

    def rule(bb, hh, qi, kj):
        visible = (kj // block) <= (qi // block)
        lengths = torch.tensor([kv_len - p for p in pad])
        return visible & (kj < lengths[bb])

    return additive_mask(rule, b, q_len, kv_len, torch.float32, kv_cache_len=kv_len - q_len)


@pytest.mark.parametrize("cached_for", [OTHERS, VERIFIERS])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("masked,q_len", [(False, 10), (True, 10), (True, 6)])
def test_closed_form_equals_an_explicit_second_pass(shift, masked, q_len, cached_for):
    torch.manual_seed(shift * 10 + q_len)
    b, h, h_kv, kv_len, d = 2, 4, 2, 10, 8  # grouped-query attention: 2 heads per KV head
    q = torch.randn(b, h, q_len, d)
    k, v = torch.randn(b, h_kv, kv_len, d), torch.randn(b, h_kv, kv_len, d)
    cached_k, cached_v = torch.randn(b, h_kv, kv_len, d), torch.randn(b, h_kv, kv_len, d)
    seeds = torch.zeros(b, kv_len, dtype=torch.bool)
    seeds[0, [5, 7, 9]] = True
    seeds[1, [4, 8]] = True
    mask = block_mask(b, q_len, kv_len, block=3, pad=[0, 1]) if masked else None
    step = KVOverrideStep(seeds=seeds, cached={0: (cached_k, cached_v)}, shift=shift, attention_layer=0,
                          cached_for=cached_for)
    scale = d**-0.5
    out, _ = kv_override_attention(Layer(), q, k, v, mask, scaling=scale, kv_override=step)  # [b, q, h, d]
    reference = explicit_two_pass(q, k, v, cached_k, cached_v, seeds, mask, shift, scale, cached_for)  # [b, h, q, d]
    torch.testing.assert_close(out.transpose(1, 2).double(), reference, atol=1e-5, rtol=1e-5)
    assert step.attention.shape == (b, q_len, kv_len)
    torch.testing.assert_close(step.attention.sum(-1), torch.ones(b, q_len), atol=1e-5, rtol=0)
    assert step.recorded[0][0] is not None and torch.equal(step.recorded[0][0], k)


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
    assert not torch.allclose(outputs[0][0, 3], plain_override[0, 3]) and torch.allclose(outputs[0][0, 2], plain_override[0, 2])
    assert not torch.allclose(outputs[1][0, 2], plain_override[0, 2]) and torch.allclose(outputs[1][0, 3], plain_override[0, 3])


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
