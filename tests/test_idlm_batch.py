"""I-DLM batch builder: against a per-token reference loop, and through real tiny HF models."""

from __future__ import annotations

import random

import pytest
import torch

from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.data_pipelines.packing import greedy_pack
from pardec.masks.core import dense_additive_mask
from pardec.masks.idlm import idlm_mask
from pardec.methods.registry import build_method
from tests import conftest
from tests.train_utils import compose_train

MASK_ID = 63
PAD_ID = 0
VOCAB = 64


def tiny_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0):
    """The shared tiny model at this file's vocabulary, 128 positions, no special token ids."""
    return conftest.tiny_model(VOCAB, arch, seed, attn_implementation, max_position_embeddings=128,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)


def random_samples(spec: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """``spec``: (length, prompt_len) per sample; tokens in [1, MASK_ID)."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(1, MASK_ID) for _ in range(n)], "prompt_len": p} for n, p in spec]


def reference_batch(samples, block, pack, supervise_last_prompt_slot=False):
    """Per-token loop: greedy packing, [x_t | x_0], shifted answer-only labels, padding. x_t labels
    only on <|mask|> inputs, plus the last prompt token's slot when ``supervise_last_prompt_slot``."""
    rows, current, used = [], [], 0
    for s in samples:
        if used + 2 * len(s["input_ids"]) > pack:
            rows.append(current)
            current, used = [], 0
        current.append(s)
        used += 2 * len(s["input_ids"])
    rows.append(current)
    keys = ("input_ids", "position_ids", "labels_mask_stream", "labels_clean_stream", "segment_ids", "stream",
            "block_ids")
    out = {k: [] for k in keys}
    for row in rows:
        r = {k: [] for k in keys}
        for seg, s in enumerate(row):
            ids, p = s["input_ids"], s["prompt_len"]
            for stream in (0, 1):
                for i, tok in enumerate(ids):
                    answer_target = i + 1 < len(ids) and i + 1 >= p
                    label = ids[i + 1] if answer_target else -100
                    x_t_target = i >= p or (supervise_last_prompt_slot and i == p - 1)
                    r["input_ids"].append(MASK_ID if stream == 0 and i >= p else tok)
                    r["position_ids"].append(i)
                    r["labels_mask_stream"].append(label if stream == 0 and x_t_target else -100)
                    r["labels_clean_stream"].append(label if stream == 1 else -100)
                    r["segment_ids"].append(seg)
                    r["stream"].append(stream)
                    r["block_ids"].append(i // block)
        while len(r["input_ids"]) < pack:
            for k, v in zip(keys, (PAD_ID, 0, -100, -100, -1, 1, 0)):
                r[k].append(v)
        for k in keys:
            out[k].append(r[k])
    return {k: torch.tensor(v) for k, v in out.items()}


SAMPLE_SETS = [  # (samples as (length, prompt_len), block size, pack length)
    ([(7, 3)], 2, 14),
    ([(7, 3), (4, 1), (5, 5), (6, 0)], 3, 24),
    ([(3, 2), (9, 4), (2, 1), (2, 0), (8, 3)], 4, 20),
    ([(5, 2), (5, 2), (5, 2)], 1, 31),
]


@pytest.mark.parametrize("supervise", [False, True])
@pytest.mark.parametrize("spec,block,pack", SAMPLE_SETS)
def test_batch_matches_reference_loop(spec, block, pack, supervise):
    samples = random_samples(spec, seed=len(spec))
    batch = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=block, pack_length=pack, pad_token_id=PAD_ID,
                             supervise_last_prompt_slot=supervise)
    ref = reference_batch(samples, block, pack, supervise)
    for k in ("input_ids", "position_ids", "labels_mask_stream", "labels_clean_stream"):
        assert torch.equal(batch[k], ref[k]), k
    spec_ = batch["attention"]
    assert spec_.factory is idlm_mask
    for k in ("segment_ids", "stream", "block_ids"):
        assert torch.equal(spec_.metadata[k], ref[k]), k
    assert torch.equal(spec_.metadata["position_ids"], batch["position_ids"])
    # answer targets (the denominator of both losses): the same in both settings
    n_answer = sum(len(s["input_ids"]) - max(s["prompt_len"], 1) for s in samples)
    assert int(batch["n_answer_tokens"]) == n_answer == int((batch["labels_clean_stream"] != -100).sum())
    # x_t targets: one fewer per sample whose last prompt token predicts an answer token, unless supervised
    anchors = sum(1 <= s["prompt_len"] < len(s["input_ids"]) for s in samples)
    assert int((batch["labels_mask_stream"] != -100).sum()) == n_answer - (0 if supervise else anchors)
    on_clean_input = (batch["labels_mask_stream"] != -100) & (batch["input_ids"] != MASK_ID)
    assert int(on_clean_input.sum()) == (anchors if supervise else 0)


@pytest.mark.parametrize("supervise", [False, True])
def test_label_convention_on_one_sample(supervise):
    batch = build_idlm_batch([{"input_ids": [10, 11, 12, 13, 14], "prompt_len": 2}],
                             mask_token_id=MASK_ID, block_size=2, pack_length=12, supervise_last_prompt_slot=supervise)
    m, i = MASK_ID, -100
    assert batch["input_ids"].tolist() == [[10, 11, m, m, m, 10, 11, 12, 13, 14, PAD_ID, PAD_ID]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 0]]
    # The last prompt position (clean in x_t) predicts the first answer token in x_0, and in x_t
    # only when supervise_last_prompt_slot (default: L_mask on the <|mask|> slots only,
    # docs/methods/idlm.md#loss).
    anchor = 12 if supervise else i
    assert batch["labels_mask_stream"].tolist() == [[i, anchor, 13, 14, i, i, i, i, i, i, i, i]]
    assert batch["labels_clean_stream"].tolist() == [[i, i, i, i, i, i, 12, 13, 14, i, i, i]]
    assert int(batch["n_answer_tokens"]) == 3


def test_default_supervises_mask_slots_only():
    samples = random_samples([(7, 3), (5, 1), (4, 4), (6, 0)], seed=3)
    default = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=2, pack_length=44)
    off = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=2, pack_length=44,
                           supervise_last_prompt_slot=False)
    assert torch.equal(default["labels_mask_stream"], off["labels_mask_stream"])
    supervised = default["labels_mask_stream"] != -100
    assert supervised.any() and bool((default["input_ids"][supervised] == MASK_ID).all())


@pytest.mark.parametrize("overrides, expected", [
    (["recipe=idlm"], False),
    (["recipe=idlm_lora"], False),
    (["recipe=idlm", "recipe.supervise_last_prompt_slot=true"], True),
    (["recipe=idlm_lora", "recipe.supervise_last_prompt_slot=true"], True),
    # the experiments use the default of docs/methods/idlm.md#loss
    (["experiment=idlm_default"], False),
    (["experiment=idlm_lora_default"], False),
])
def test_recipe_option_reaches_the_batch_builder(overrides, expected):
    cfg = compose_train(overrides)
    assert cfg.recipe.supervise_last_prompt_slot is expected
    method = build_method(cfg.recipe, conftest.tiny_tokenizer())
    method.mask_token_id, method.pack_length = MASK_ID, 40
    samples = random_samples([(7, 3), (5, 1), (6, 2)], seed=4)
    want = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=cfg.recipe.stride - 1, pack_length=40,
                            supervise_last_prompt_slot=expected)
    got = method.collate(samples)
    for k in ("input_ids", "labels_mask_stream", "labels_clean_stream"):
        assert torch.equal(got[k], want[k]), k


def test_greedy_pack_keeps_order():
    assert greedy_pack([4, 4, 6, 2, 10, 1], 10) == [[0, 1], [2, 3], [4], [5]]


@pytest.mark.parametrize(
    "samples,match",
    [
        ([{"input_ids": [1, 2, 3], "prompt_len": 1}, {"input_ids": [1] * 6, "prompt_len": 1}],
         r"sample 1: length L=6 needs 2L=12 slots .* pack_length=10"),
        ([{"input_ids": [1, 2, MASK_ID], "prompt_len": 1}], r"sample 0: .*mask token id 63 at position 2"),
        ([{"input_ids": [1, 2], "prompt_len": 3}], r"sample 0: prompt_len=3 outside \[0, 2\]"),
        ([{"input_ids": [], "prompt_len": 0}], r"sample 0: input_ids must be a non-empty"),
        ([], r"no samples"),
    ],
)
def test_bad_inputs_name_the_offender(samples, match):
    with pytest.raises(ValueError, match=match):
        build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=2, pack_length=10)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        build_idlm_batch(random_samples([(3, 1)]), mask_token_id=MASK_ID, block_size=0, pack_length=10)


# --- one packed forward through real models -------------------------------------------------------

PACKED = ([(7, 3), (5, 1), (4, 4), (9, 4), (6, 0)], 3, 32)  # rows of 3 and 2 samples, 2 pads


def packed_forward(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=dense_additive_mask(batch["attention"]), use_cache=False).logits


def sample_slices(batch):
    """(row, offset, length) of every packed sample, from the metadata."""
    seg = batch["attention"].metadata["segment_ids"]
    out = []
    for r in range(seg.shape[0]):
        for s in range(int(seg[r].max()) + 1):
            idx = (seg[r] == s).nonzero().flatten()
            out.append((r, int(idx[0]), idx.numel() // 2))
    return out


@pytest.mark.parametrize("arch,impl", [("qwen3", "sdpa"), ("llama", "sdpa"), ("qwen3", "eager")])
def test_packed_forward_matches_separate_forwards(arch, impl):
    spec, block, pack = PACKED
    samples = random_samples(spec, seed=5)
    model = tiny_model(arch, impl)
    batch = build_idlm_batch(samples, mask_token_id=MASK_ID, block_size=block, pack_length=pack)
    logits = packed_forward(model, batch)  # [b, s, V]
    slices = sample_slices(batch)
    assert len(slices) == len(samples) and batch["input_ids"].shape[0] == 2

    for sample, (row, off, length) in zip(samples, slices):
        ids = torch.tensor(sample["input_ids"])
        noisy = batch["input_ids"][row, off: off + length]
        with torch.no_grad():
            # Clean stream == a plain causal forward of x_0 alone.
            clean_ref = model(input_ids=ids[None]).logits[0]
            torch.testing.assert_close(logits[row, off + length: off + 2 * length], clean_ref, atol=1e-5, rtol=1e-5)
            # Each x_t block == a forward on [clean x_0 before the block, the block's x_t tokens].
            for start in range(0, length, block):
                end = min(start + block, length)
                ref = model(input_ids=torch.cat([ids[:start], noisy[start:end]])[None]).logits[0, start:end]
                torch.testing.assert_close(logits[row, off + start: off + end], ref, atol=1e-5, rtol=1e-5)
        # The x_t query at the last prompt position (an L_mask target only with
        # supervise_last_prompt_slot) is the causal anchor: its logits are x_0's at that position.
        last_prompt = sample["prompt_len"] - 1
        if last_prompt >= 0:
            torch.testing.assert_close(logits[row, off + last_prompt], logits[row, off + length + last_prompt],
                                       atol=1e-5, rtol=1e-5)


def test_eager_and_sdpa_agree_on_the_packed_batch():
    spec, block, pack = PACKED
    batch = build_idlm_batch(random_samples(spec, seed=6), mask_token_id=MASK_ID, block_size=block, pack_length=pack)
    sdpa = packed_forward(tiny_model("qwen3", "sdpa"), batch)
    eager = packed_forward(tiny_model("qwen3", "eager"), batch)
    real = batch["attention"].metadata["segment_ids"] >= 0  # padding rows are never used
    torch.testing.assert_close(sdpa[real], eager[real], atol=1e-5, rtol=1e-5)
