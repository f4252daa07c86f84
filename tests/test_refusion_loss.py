"""ReFusion loss against a naive per-slot loop over the layouts, and its empty cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pardec.data_pipelines.refusion_batch import build_refusion_batch, draw_layout, layout_seed
from pardec.losses.refusion import refusion_loss

MASK_ID = 63
VOCAB = 64
SIZES = (2, 3, 4)


def samples_and_batch(spec, masking="count", seed=0, pack=40, sizes=SIZES):
    rng = random.Random(seed)
    samples = [{"input_ids": [rng.randrange(1, MASK_ID) for _ in range(n)], "prompt_len": p} for n, p in spec]
    seeds = [layout_seed(seed, 0, 0, i) for i in range(len(samples))]
    batch = build_refusion_batch(samples, mask_token_id=MASK_ID, pack_length=pack, seeds=seeds,
                                 slot_sizes=sizes, masking=masking)
    return samples, seeds, batch


def naive_loss(logits, samples, seeds, batch, masking, norm, lam):
    """Walk every sample's slots; find each token's buffer index by its (row, position); CE by log_softmax."""
    segments = batch["attention"].metadata["segment_ids"]
    where = {}  # sample -> (row, {position: buffer index})
    sample = 0
    for r in range(segments.shape[0]):
        for s in range(int(segments[r].max()) + 1):
            idx = (segments[r] == s).nonzero().flatten().tolist()
            where[sample] = (r, {int(batch["position_ids"][r, i]): i for i in idx})
            sample += 1
    arm_terms, mdm_terms, llada = [], [], 0.0
    for n, (s, seed) in enumerate(zip(samples, seeds)):
        ids, p = s["input_ids"], s["prompt_len"]
        n_answer = len(ids) - p
        layout = draw_layout(n_answer, random.Random(seed), SIZES, masking)
        r, at = where[n]
        k = layout.slot_size
        for slot in range(layout.n_slots):
            positions = list(range(p + slot * k, p + min((slot + 1) * k, n_answer)))
            for j, pos in enumerate(positions):
                if slot in layout.masked:  # the mask predicts its own token
                    nll = -torch.log_softmax(logits[r, at[pos]], -1)[ids[pos]]
                    mdm_terms.append(nll)
                    llada += float(nll) / (layout.p_mask * n_answer)
                elif j + 1 < len(positions):  # clean: next token inside the slot
                    arm_terms.append(-torch.log_softmax(logits[r, at[pos]], -1)[ids[positions[j + 1]]])
    l_arm = float(torch.stack(arm_terms).mean()) if arm_terms else 0.0
    if norm == "mean":
        l_mdm = float(torch.stack(mdm_terms).mean()) if mdm_terms else 0.0
    else:
        l_mdm = llada / len(samples)
    return l_arm + lam * l_mdm, l_arm, l_mdm


@pytest.mark.parametrize("masking", ["count", "bernoulli"])
@pytest.mark.parametrize("norm", ["mean", "llada"])
def test_loss_equals_naive_per_slot_loop(masking, norm):
    spec = [(14, 4), (9, 2), (8, 8), (12, 3), (10, 1), (6, 5)]
    for seed in range(4):
        samples, seeds, batch = samples_and_batch(spec, masking, seed)
        logits = torch.randn(*batch["input_ids"].shape, VOCAB, generator=torch.Generator().manual_seed(seed))
        total, logs = refusion_loss(logits, batch["labels_arm"], batch["labels_mdm"], mdm_lambda=0.7, mdm_norm=norm,
                                    mdm_sample=batch["mdm_sample"], mdm_weight=batch["mdm_weight"])
        ref_total, ref_arm, ref_mdm = naive_loss(logits, samples, seeds, batch, masking, norm, 0.7)
        assert float(total) == pytest.approx(ref_total, rel=1e-5)
        assert logs["l_arm"] == pytest.approx(ref_arm, rel=1e-5)
        assert logs["l_mdm"] == pytest.approx(ref_mdm, rel=1e-5)
        assert logs["n_mdm_tokens"] == float((batch["labels_mdm"] != -100).sum())


@pytest.mark.parametrize("norm", ["mean", "llada"])
def test_all_masked_batch_is_finite_with_zero_arm(norm):
    # One-slot answers (k >= answer length) under count masking: every slot masked, no ARM target.
    _, _, batch = samples_and_batch([(6, 3), (5, 3), (4, 2)], "count", 1, pack=15, sizes=(4,))
    assert (batch["labels_arm"] == -100).all()
    logits = torch.randn(*batch["input_ids"].shape, VOCAB, requires_grad=True)
    total, logs = refusion_loss(logits, batch["labels_arm"], batch["labels_mdm"], mdm_norm=norm,
                                mdm_sample=batch["mdm_sample"], mdm_weight=batch["mdm_weight"])
    total.backward()
    assert logs["l_arm"] == 0.0 and logs["n_arm_tokens"] == 0.0
    assert math.isfinite(float(total.detach())) and logs["l_mdm"] > 0
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("norm", ["mean", "llada"])
def test_no_label_at_all_is_an_exact_zero_in_the_graph(norm):
    # Empty answers only (prompt = whole sample): nothing to learn, never NaN.
    _, _, batch = samples_and_batch([(4, 4), (3, 3)], "count", 0, pack=8)
    logits = torch.full((*batch["input_ids"].shape, VOCAB), float("inf"), requires_grad=True)
    total, logs = refusion_loss(logits, batch["labels_arm"], batch["labels_mdm"], mdm_norm=norm,
                                mdm_sample=batch["mdm_sample"], mdm_weight=batch["mdm_weight"])
    total.backward()
    assert float(total.detach()) == 0.0 and logs == {"l_arm": 0.0, "l_mdm": 0.0, "n_arm_tokens": 0.0,
                                                     "n_mdm_tokens": 0.0}
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bad_arguments():
    labels = torch.full((1, 4), -100)
    with pytest.raises(ValueError, match="is not a valid MDMNorm: expected one of"):
        refusion_loss(torch.zeros(1, 4, 8), labels, labels, mdm_norm="sum")
    with pytest.raises(ValueError, match="needs mdm_sample"):
        refusion_loss(torch.zeros(1, 4, 8), labels, labels, mdm_norm="llada")
    with pytest.raises(ValueError, match="do not match"):
        refusion_loss(torch.zeros(1, 5, 8), labels, labels)
