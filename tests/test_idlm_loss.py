"""I-DLM loss on a packed batch against a naive per-sample computation with separate forwards."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.losses.idlm import idlm_loss
from pardec.methods.base import forward_logits
from tests.test_idlm_batch import MASK_ID, random_samples, tiny_model

SHAPES, BLOCK, PACK = [(7, 3), (5, 1), (4, 4), (9, 4), (6, 0)], 3, 32


def naive_losses(model, samples, block, supervise_last_prompt_slot=False):
    """(L_mask, L_clean, count) from one forward per supervised query, each sample alone.

    x_t query i sees the clean tokens before its block, then its block's x_t tokens up to i; x_0
    query i sees x_0[: i + 1]. Targets: x_0[i + 1] when it is an answer token; in x_t only at
    <|mask|> inputs (i >= P), plus i = P - 1 when ``supervise_last_prompt_slot``. Both losses are
    divided by ``count``, the number of answer targets (docs/methods/idlm.md#loss), in both settings.
    """
    mask_sum = clean_sum = 0.0
    count = 0
    with torch.no_grad():
        for s in samples:
            ids, p = torch.tensor(s["input_ids"]), s["prompt_len"]
            noisy = torch.where(torch.arange(len(ids)) >= p, MASK_ID, ids)
            for i in range(len(ids) - 1):
                if i + 1 < p:
                    continue
                start = (i // block) * block
                q_mask = model(input_ids=torch.cat([ids[:start], noisy[start: i + 1]])[None]).logits[0, -1]
                q_clean = model(input_ids=ids[None, : i + 1]).logits[0, -1]
                if i >= p or supervise_last_prompt_slot:
                    mask_sum -= float(torch.log_softmax(q_mask, -1)[ids[i + 1]])
                clean_sum -= float(torch.log_softmax(q_clean, -1)[ids[i + 1]])
                count += 1
    return mask_sum / count, clean_sum / count, count


@pytest.fixture(scope="module", params=[False, True], ids=["anchor_off", "anchor_on"])
def setup(request):
    model = tiny_model("qwen3", "sdpa", seed=1)
    samples = random_samples(SHAPES, seed=11)
    batch = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=BLOCK, pack_length=PACK,
                             supervise_last_prompt_slot=request.param)
    return model, samples, batch, naive_losses(model, samples, BLOCK, request.param)


@pytest.mark.parametrize("clean_scale", ["auto", 0.2, 0.0])
def test_loss_matches_naive_per_sample_computation(setup, clean_scale):
    model, _, batch, (l_mask, l_clean, count) = setup
    with torch.no_grad():
        logits = forward_logits(model, batch)
    total, logs = idlm_loss(logits, batch["labels_mask_stream"], batch["labels_clean_stream"], clean_scale)
    scale = l_mask / (l_clean + 1e-8) if clean_scale == "auto" else clean_scale
    assert logs["n_answer_tokens"] == count == int(batch["n_answer_tokens"])
    assert math.isclose(logs["l_mask"], l_mask, rel_tol=1e-5)
    assert math.isclose(logs["l_clean"], l_clean, rel_tol=1e-5)
    assert math.isclose(logs["scale"], scale, rel_tol=1e-5)
    assert math.isclose(float(total), l_mask + scale * l_clean, rel_tol=1e-5)
    if clean_scale == "auto":
        assert math.isclose(float(total), 2 * l_mask, rel_tol=1e-5)


def test_anchor_terms_are_the_only_difference():
    """L_mask(on) - L_mask(off) = the anchors' CE / the answer count, and each anchor's CE is the
    clean stream's CE of the first answer token (the anchor's logits are the causal ones)."""
    model = tiny_model("qwen3", "sdpa", seed=1)
    samples = random_samples(SHAPES, seed=11)
    logs, batches = {}, {}
    for supervise in (False, True):
        batches[supervise] = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=BLOCK, pack_length=PACK,
                                              supervise_last_prompt_slot=supervise)
        with torch.no_grad():
            logits = forward_logits(model, batches[supervise])
        logs[supervise] = idlm_loss(logits, batches[supervise]["labels_mask_stream"],
                                    batches[supervise]["labels_clean_stream"], 0.0)[1]
    count = int(batches[False]["n_answer_tokens"])
    assert logs[False]["n_answer_tokens"] == logs[True]["n_answer_tokens"] == count
    anchors = [s for s in samples if 1 <= s["prompt_len"] < len(s["input_ids"])]
    assert anchors
    first_answer_ce = 0.0
    with torch.no_grad():
        for s in anchors:
            ids, p = torch.tensor(s["input_ids"]), s["prompt_len"]
            first_answer_ce -= float(torch.log_softmax(model(input_ids=ids[None, :p]).logits[0, -1], -1)[ids[p]])
    assert math.isclose(logs[True]["l_mask"] - logs[False]["l_mask"], first_answer_ce / count, rel_tol=1e-4)


def test_mask_targets_beyond_the_answer_targets_are_refused():
    labels = torch.full((1, 4), -100)
    mask_labels = labels.clone()
    mask_labels[0, 1] = 3
    with pytest.raises(ValueError, match="labels_mask_stream has 1 targets but labels_clean_stream only 0"):
        idlm_loss(torch.zeros(1, 4, 8), mask_labels, labels)


def _grads(model, batch, clean_scale):
    model.zero_grad()
    logits = forward_logits(model, batch)
    idlm_loss(logits, batch["labels_mask_stream"], batch["labels_clean_stream"], clean_scale)[0].backward()
    return [p.grad.clone() for p in model.parameters()]


def test_auto_scale_is_not_differentiated(setup):
    """Gradients with ``auto`` equal those with the same scale given as a fixed number."""
    model, _, batch, _ = setup
    with torch.no_grad():
        logits = forward_logits(model, batch)
    scale = idlm_loss(logits, batch["labels_mask_stream"], batch["labels_clean_stream"], "auto")[1]["scale"]
    for auto, fixed in zip(_grads(model, batch, "auto"), _grads(model, batch, scale)):
        torch.testing.assert_close(auto, fixed, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("clean_scale", ["auto", 0.2])
def test_no_answer_tokens_gives_zero_not_nan(clean_scale):
    model = tiny_model("llama", "sdpa")
    samples = random_samples([(4, 4), (3, 3)])  # prompts only
    batch = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=2, pack_length=16)
    model.zero_grad()
    total, logs = idlm_loss(forward_logits(model, batch), batch["labels_mask_stream"], batch["labels_clean_stream"],
                            clean_scale)
    total.backward()
    assert float(total.detach()) == 0.0 and logs == {"l_mask": 0.0, "l_clean": 0.0, "scale": logs["scale"],
                                                     "n_answer_tokens": 0.0}
    assert logs["scale"] == (0.0 if clean_scale == "auto" else 0.2)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


@pytest.mark.parametrize("bad", ["balanced", -0.1, float("nan")])
def test_bad_clean_scale(bad):
    labels = torch.full((1, 4), -100)
    with pytest.raises(ValueError, match="clean_scale must be 'auto' or a number >= 0"):
        idlm_loss(torch.zeros(1, 4, 8), labels, labels, bad)


def test_shape_mismatch():
    labels = torch.full((1, 4), -100)
    with pytest.raises(ValueError, match=r"logits \(1, 5, 8\) do not match labels \(1, 4\)"):
        idlm_loss(torch.zeros(1, 5, 8), labels, labels)
