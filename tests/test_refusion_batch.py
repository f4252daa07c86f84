"""ReFusion training buffers and mask: against a brute-force construction, and through tiny HF models."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pardec.data_pipelines.refusion_batch import Masking, build_refusion_batch, draw_layout, layout_seed
from pardec.masks.core import dense_additive_mask
from pardec.masks.refusion import refusion_mask
from tests import conftest

MASK_ID = 63
PAD_ID = 0
VOCAB = 64


def tiny_model(arch: str = "qwen3", attn_implementation: str = "sdpa", seed: int = 0):
    return conftest.tiny_model(VOCAB, arch, seed, attn_implementation)


def random_samples(spec: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """``spec``: (length, prompt_len) per sample; tokens in [1, MASK_ID)."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(1, MASK_ID) for _ in range(n)], "prompt_len": p} for n, p in spec]


def brute_force_batch(samples, seeds, slot_sizes, masking, pack, in_order_prob=0.0, across=False):
    """Token by token: sort every answer token by (clean rank | masked, position), label it, pack, pad.
    ARM targets from the finished buffer: a clean answer token (or, ``across``, the prompt's last
    token) predicts the next buffer token when that one is clean and at the next position, inside
    its slot (or, ``across``, in any slot)."""
    rows, current, used = [], [], 0
    for i, s in enumerate(samples):
        if current and used + len(s["input_ids"]) > pack:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += len(s["input_ids"])
    rows.append(current)
    keys = ("input_ids", "position_ids", "labels_arm", "labels_mdm", "mdm_sample", "segment_ids")
    out = {k: [] for k in keys}
    for row in rows:
        r = {k: [] for k in keys}
        for seg, i in enumerate(row):
            ids, p = samples[i]["input_ids"], samples[i]["prompt_len"]
            n_answer = len(ids) - p
            layout = draw_layout(n_answer, random.Random(seeds[i]), slot_sizes, masking, in_order_prob)
            k = layout.slot_size
            start = len(r["input_ids"])
            for pos in range(p):
                for key, v in zip(keys, (ids[pos], pos, -100, -100, -1, seg)):
                    r[key].append(v)

            def order(a, k=k, layout=layout):
                slot = a // k
                return (1, a) if slot in layout.masked else (0, layout.clean_order.index(slot), a)

            for a in sorted(range(n_answer), key=order):
                masked = (a // k) in layout.masked
                r["input_ids"].append(MASK_ID if masked else ids[p + a])
                r["position_ids"].append(p + a)
                r["labels_arm"].append(-100)
                r["labels_mdm"].append(ids[p + a] if masked else -100)
                r["mdm_sample"].append(i if masked else -1)
                r["segment_ids"].append(seg)
            for q in range(start + max(p - 1, 0), len(r["input_ids"]) - 1):  # the prompt's last token on
                pos, nxt = r["position_ids"][q], r["position_ids"][q + 1]
                clean = r["input_ids"][q] != MASK_ID and r["input_ids"][q + 1] != MASK_ID
                same_slot = pos >= p and (pos - p) // k == (nxt - p) // k
                if clean and nxt == pos + 1 and (same_slot or across):
                    r["labels_arm"][q] = ids[nxt]
        while len(r["input_ids"]) < pack:
            for key, v in zip(keys, (PAD_ID, 0, -100, -100, -1, -1)):
                r[key].append(v)
        for key in keys:
            out[key].append(r[key])
    return {k: torch.tensor(v) for k, v in out.items()}


SAMPLE_SETS = [  # (samples as (length, prompt_len), slot sizes, pack length)
    ([(12, 3)], (4,), 12),
    ([(12, 3), (5, 5), (6, 5), (9, 0)], (2, 3), 24),  # empty answer, one-token (one-slot) answer, no prompt
    ([(20, 4), (7, 2), (3, 1), (11, 6), (14, 2)], (4, 8, 16, 32), 32),
    ([(10, 2), (10, 2), (10, 2)], (1,), 31),
]


@pytest.mark.parametrize("in_order_prob,across", [(0.0, False), (0.5, True), (0.0, True)])
@pytest.mark.parametrize("masking", ["count", "bernoulli"])
@pytest.mark.parametrize("spec,sizes,pack", SAMPLE_SETS)
def test_buffer_matches_brute_force(spec, sizes, pack, masking, in_order_prob, across):
    samples = random_samples(spec, seed=len(spec))
    for trial in range(6):
        seeds = [layout_seed(7, trial, 0, i) for i in range(len(samples))]
        batch = build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=pack, seeds=seeds,
                                     slot_sizes=sizes, masking=masking, in_order_prob=in_order_prob,
                                     ar_across_slots=across, pad_token_id=PAD_ID)
        ref = brute_force_batch(samples, seeds, sizes, masking, pack, in_order_prob, across)
        for key in ("input_ids", "position_ids", "labels_arm", "labels_mdm", "mdm_sample"):
            assert torch.equal(batch[key], ref[key]), (key, trial)
        assert batch["attention"].factory is refusion_mask
        assert batch["attention"].causal_document is False  # flash-attn must never see permuted positions
        assert torch.equal(batch["attention"].metadata["segment_ids"], ref["segment_ids"])
        assert batch["n_samples"] == len(samples)


def test_one_sample_layout_by_hand():
    """The docstring example: answer a0..a5 after 2 prompt tokens, k = 2, slot 1 masked."""
    ids = [10, 11, 20, 21, 22, 23, 24, 25]
    seed = next(s for s in range(10_000)
                if draw_layout(6, random.Random(s), (2,), "count").masked == (1,)
                and draw_layout(6, random.Random(s), (2,), "count").clean_order == (2, 0))
    batch = build_refusion_batch([{"input_ids": ids, "prompt_len": 2}], mask_token_id=MASK_ID, pack_length=8,
                                 seeds=[seed], slot_sizes=(2,))
    m, i = MASK_ID, -100
    assert batch["input_ids"].tolist() == [[10, 11, 24, 25, 20, 21, m, m]]
    assert batch["position_ids"].tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    assert batch["labels_arm"].tolist() == [[i, i, 25, i, 21, i, i, i]]
    assert batch["labels_mdm"].tolist() == [[i, i, i, i, i, i, 22, 23]]


@pytest.mark.parametrize("masking", ["count", "bernoulli"])
def test_layout_draws(masking):
    seen_none = seen_all = False
    for seed in range(400):
        n_answer = 1 + seed % 40
        sizes = (4, 8, 16, 32)
        layout = draw_layout(n_answer, random.Random(seed), sizes, masking)
        rng = random.Random(seed)
        k = rng.choice(list(sizes))
        t = rng.random()
        assert layout.slot_size == k and layout.n_slots == math.ceil(n_answer / k)
        assert sorted(layout.masked + layout.clean_order) == list(range(layout.n_slots))
        if masking == "count":
            assert len(layout.masked) == max(1, math.floor(t * layout.n_slots))
        else:
            assert layout.p_mask == pytest.approx((1 - 1e-3) * t + 1e-3)
        seen_none |= not layout.masked
        seen_all |= len(layout.masked) == layout.n_slots
    assert seen_all
    assert seen_none == (masking == "bernoulli")  # count masking always masks >= 1 slot


def test_clean_slots_are_permuted():
    orders = {draw_layout(64, random.Random(s), (4,), "count").clean_order[:3] for s in range(50)}
    assert len(orders) > 10
    assert any(list(o) != sorted(o) for o in orders)


def test_in_order_prob_keeps_the_clean_slots_in_position_order():
    """Same slot size and masked slots as the paper's rule (drawn first); with probability 1 the clean
    slots stay sorted, with 0 the layouts are exactly the default ones, in between a mix."""
    for seed in range(100):
        plain = draw_layout(64, random.Random(seed), (4, 8), "count")
        ordered = draw_layout(64, random.Random(seed), (4, 8), "count", in_order_prob=1.0)
        assert (ordered.slot_size, ordered.masked) == (plain.slot_size, plain.masked)
        assert list(ordered.clean_order) == sorted(plain.clean_order)
        assert draw_layout(64, random.Random(seed), (4, 8), "count", in_order_prob=0.0) == plain
    mixed = [draw_layout(64, random.Random(s), (4,), "count", in_order_prob=0.5).clean_order for s in range(200)]
    share_sorted = sum(list(o) == sorted(o) for o in mixed if len(o) > 3) / sum(len(o) > 3 for o in mixed)
    assert 0.35 < share_sorted < 0.65
    with pytest.raises(ValueError, match="in_order_prob"):
        draw_layout(64, random.Random(0), (4,), "count", in_order_prob=1.5)


@pytest.mark.parametrize("masking", list(Masking))
def test_suffix_mask_prob_masks_the_last_slots(masking):
    """Same slot size and number of masked slots as the paper's rule (drawn first); with probability 1
    they are the last ones (the clean slots a prefix), with 0 the layouts are the default ones."""
    shares = []
    for seed in range(100):
        plain = draw_layout(50, random.Random(seed), (4, 8), masking)
        suffix = draw_layout(50, random.Random(seed), (4, 8), masking, suffix_mask_prob=1.0)
        n, m = plain.n_slots, len(plain.masked)
        assert (suffix.slot_size, suffix.n_slots, len(suffix.masked)) == (plain.slot_size, n, m)
        assert suffix.masked == tuple(range(n - m, n))
        assert sorted(suffix.clean_order) == list(range(n - m))
        assert draw_layout(50, random.Random(seed), (4, 8), masking, suffix_mask_prob=0.0) == plain
        half = draw_layout(50, random.Random(seed), (4, 8), masking, suffix_mask_prob=0.5)
        if 0 < m < n and plain.masked != suffix.masked:
            shares.append(half.masked == suffix.masked)
    assert 0.3 < sum(shares) / len(shares) < 0.7
    with pytest.raises(ValueError, match="suffix_mask_prob"):
        draw_layout(50, random.Random(0), (4,), masking, suffix_mask_prob=2.0)


def test_deterministic_from_seed_and_step():
    samples = random_samples([(20, 4), (15, 3), (9, 2)], seed=1)

    def batch(step):
        seeds = [layout_seed(0, step, 0, i) for i in range(3)]
        return build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=48, seeds=seeds)

    a, b, c = batch(5), batch(5), batch(6)
    assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "position_ids", "labels_arm", "labels_mdm"))
    assert not all(torch.equal(a[k], c[k]) for k in ("input_ids", "position_ids"))


def test_all_masked_batch_has_no_arm_labels():
    # One-slot answers under count masking: every slot is masked.
    samples = random_samples([(6, 3), (5, 2)], seed=2)
    batch = build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=11, seeds=[1, 2], slot_sizes=(32,))
    assert (batch["labels_arm"] == -100).all()
    assert int((batch["labels_mdm"] != -100).sum()) == 3 + 3
    assert batch["mdm_weight"].tolist() == pytest.approx([1 / 3, 1 / 3])  # 1 / (p_mask=1 * A=3)


@pytest.mark.parametrize(
    "samples,kwargs,match",
    [
        ([{"input_ids": [1, 2, MASK_ID], "prompt_len": 1}], {}, r"sample 0: .*mask token id 63 at position 2"),
        ([{"input_ids": [1, 2], "prompt_len": 3}], {}, r"sample 0: prompt_len=3 outside \[0, 2\]"),
        ([{"input_ids": [1] * 9, "prompt_len": 1}], {}, r"sample 0 needs 9 slots > pack_length=8"),
        ([{"input_ids": [1, 2], "prompt_len": 1}], {"slot_sizes": (0,)}, r"slot sizes must be"),
        ([{"input_ids": [1, 2], "prompt_len": 1}], {"masking": "half"}, r"'half' is not a valid Masking"),
        ([], {}, r"no samples"),
    ],
)
def test_bad_inputs_name_the_offender(samples, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=8, seeds=list(range(len(samples))), **kwargs)


# --- forwards through real models -------------------------------------------------------------

PACKED = [(14, 4), (9, 2), (8, 8), (12, 3), (10, 1)]


def packed_batch(seed=3, pack=32):
    samples = random_samples(PACKED, seed=seed)
    seeds = [layout_seed(seed, 0, 0, i) for i in range(len(samples))]
    return samples, build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=pack, seeds=seeds,
                                         slot_sizes=(2, 3, 4))


def forward(model, input_ids, position_ids, mask):
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False).logits


def explicit_reference_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Built without the predicate: per row, lower-triangular blocks per segment, pads on the diagonal."""
    b, s = segment_ids.shape
    mask = torch.full((b, 1, s, s), torch.finfo(torch.float32).min)
    for r in range(b):
        for q in range(s):
            for kv in range(q + 1):
                same = segment_ids[r, q] == segment_ids[r, kv] and segment_ids[r, q] >= 0
                if same or q == kv:
                    mask[r, 0, q, kv] = 0.0
    return mask


@pytest.mark.parametrize("arch,impl", [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa"), ("llama", "eager")])
def test_every_backend_matches_explicit_float_mask(arch, impl):
    _, batch = packed_batch()
    model = tiny_model(arch, impl)
    segments = batch["attention"].metadata["segment_ids"]
    real = segments >= 0
    ours = forward(model, batch["input_ids"], batch["position_ids"], dense_additive_mask(batch["attention"]))
    ref = forward(tiny_model(arch, "eager"), batch["input_ids"], batch["position_ids"],
                  explicit_reference_mask(segments))
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


def test_position_jumps_without_a_mask_give_wrong_logits():
    """The transformers trap (docs/methods/refusion.md#the-transformers-position-id-trap): no mask +
    permuted positions is silently wrong."""
    _, batch = packed_batch()
    model = tiny_model("qwen3", "sdpa")
    row = batch["attention"].metadata["segment_ids"][0]
    first = (row == 0).nonzero().flatten()  # first sample of row 0
    ids, pos = batch["input_ids"][:1, first], batch["position_ids"][:1, first]
    assert (pos.diff() < 0).any(), "the test sample must have a permuted slot"
    with_mask = forward(model, ids, pos, dense_additive_mask(batch["attention"])[:1, :, first][:, :, :, first])
    without = forward(model, ids, pos, None)
    assert (with_mask - without).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_forward_matches_separate_forwards(arch):
    samples, batch = packed_batch()
    model = tiny_model(arch)
    logits = forward(model, batch["input_ids"], batch["position_ids"], dense_additive_mask(batch["attention"]))
    segments = batch["attention"].metadata["segment_ids"]
    assert batch["input_ids"].shape[0] >= 2  # several rows, several samples per row
    found = 0
    for r in range(segments.shape[0]):
        for s in range(int(segments[r].max()) + 1):
            idx = (segments[r] == s).nonzero().flatten()
            n = idx.numel()
            causal = torch.zeros(1, 1, n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            alone = forward(model, batch["input_ids"][r, idx][None], batch["position_ids"][r, idx][None], causal)
            torch.testing.assert_close(logits[r, idx], alone[0], atol=1e-5, rtol=1e-5)
            found += 1
    assert found == len(samples)
