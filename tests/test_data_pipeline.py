"""Tokenisation, length policy, packing, labels and the packed causal mask against reference loops,
and bad data inputs failing with messages that name them."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from pardec.common.constants import IGNORE_INDEX
from pardec.common.errors import DataError
from pardec.data_pipelines.packing import PAD_SEGMENT, pack_dataset, single_sample_rows
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import tokenize_dataset
from pardec.losses.causal_lm import shifted_labels
from pardec.masks.core import causal_document_spec, dense_additive_mask, dense_bool_mask
from pardec.methods.ar import ARConfig, ARMethod
from tests.conftest import data_cfg, synthetic_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


def raw(prompts, responses):
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses})


def test_tokenization_matches_separate_encoding(tokenizer):
    prompts = ["Question: Tom has 3 apples.\nAnswer:", "Question: Ann has 12 pens.\nAnswer:"]
    responses = [" Tom has 3 apples.\n#### 3", " Ann has 12 pens.\n#### 12"]
    # words outside the synthetic vocabulary (Ann, pens, a, b) encode as <|unk|>: not what is tested
    out = tokenize_dataset(raw(prompts, responses), tokenizer, data_cfg(max_unk_rate=None))
    for row, p, r in zip(out, prompts, responses):
        p_ids = tokenizer(p, add_special_tokens=False).input_ids
        r_ids = tokenizer(r, add_special_tokens=False).input_ids
        assert row["input_ids"] == p_ids + r_ids + [tokenizer.eos_token_id]
        assert row["prompt_len"] == len(p_ids) and row["length"] == len(row["input_ids"])


def test_length_policies(tokenizer):
    ds = raw(["Question: Tom has 3 apples.\nAnswer:"] * 3, [" Tom has 3 apples.\n#### 3", " 1", " 2"])
    full = tokenize_dataset(ds, tokenizer, data_cfg(max_length=512))
    long_len, short_len = full[0]["length"], full[1]["length"]
    limit = (long_len + short_len) // 2
    dropped = tokenize_dataset(ds, tokenizer, data_cfg(max_length=limit, length_policy="drop"))
    assert len(dropped) == 2 and all(r["length"] <= limit for r in dropped)
    truncated = tokenize_dataset(ds, tokenizer, data_cfg(max_length=limit, length_policy="truncate"))
    assert len(truncated) == 3 and truncated[0]["input_ids"] == full[0]["input_ids"][:limit]
    with pytest.raises(DataError, match=rf"sample 0 has {long_len} tokens > data.max_length={limit}"):
        tokenize_dataset(ds, tokenizer, data_cfg(max_length=limit, length_policy="error"))


def test_drop_everything_is_an_error(tokenizer):
    ds = raw(["Question: Tom has 3 apples.\nAnswer:"], [" Tom has 3 apples.\n#### 3"])
    with pytest.raises(DataError, match="data.max_length=4"):
        tokenize_dataset(ds, tokenizer, data_cfg(max_length=4, length_policy="drop"))


def _reference_pack(lengths, pack_length):
    rows, current = [], []
    for i, n in enumerate(lengths):
        if current and sum(lengths[j] for j in current) + n > pack_length:
            rows.append(current)
            current = []
        current.append(i)
    return rows + [current]


def test_packing_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 20, (57,), generator=g).tolist()
    samples = [[100 * i + k for k in range(n)] for i, n in enumerate(lengths)]
    ds = datasets.Dataset.from_dict({"input_ids": samples, "loss_mask": [[1] * n for n in lengths], "length": lengths})
    packed = pack_dataset(ds, pack_length=40, token_columns=("input_ids", "loss_mask"), batch_size=1000)
    expected = _reference_pack(lengths, 40)
    assert len(packed) == len(expected)
    for row, members in zip(packed, expected):
        assert row["input_ids"] == [t for i in members for t in samples[i]]
        assert row["position_ids"] == [p for i in members for p in range(lengths[i])]
        assert row["segment_ids"] == [s for s, i in enumerate(members) for _ in range(lengths[i])]
        assert row["length"] == len(row["input_ids"]) <= 40


def test_pack_rejects_overlong_sample():
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * 9], "length": [9]})
    with pytest.raises(DataError, match="data.pack_length"):
        pack_dataset(ds, pack_length=8, token_columns=("input_ids",))


def test_shifted_labels_match_loop():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (3, 12), generator=g)
    seg = torch.tensor([[0] * 5 + [1] * 4 + [PAD_SEGMENT] * 3, [0] * 12, [0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3]])
    target = torch.rand(3, 12, generator=g) > 0.3
    labels = shifted_labels(ids, seg, target)
    for b in range(3):
        for i in range(12):
            ok = i + 1 < 12 and seg[b, i] == seg[b, i + 1] and seg[b, i] >= 0 and target[b, i + 1]
            assert labels[b, i] == (ids[b, i + 1] if ok else IGNORE_INDEX)


def test_causal_document_mask_matches_loop():
    seg = torch.tensor([[0, 0, 0, 1, 1, PAD_SEGMENT], [0, 1, 1, 1, 2, 2]])
    allowed = dense_bool_mask(causal_document_spec(seg).mask_mod(), 2, 6, 6)
    additive = dense_additive_mask(causal_document_spec(seg))
    for b in range(2):
        for q in range(6):
            for kv in range(6):
                ok = (seg[b, q] == seg[b, kv] and seg[b, q] >= 0 and kv <= q) or q == kv
                assert bool(allowed[b, q, kv]) == ok
                assert (additive[b, 0, q, kv] == 0) == ok


def test_packed_forward_equals_separate_forwards(tokenizer):
    """One packed AR forward through a real model = each sample alone (nothing leaks)."""
    from pardec.methods.base import forward_logits

    model = tiny_model(len(tokenizer))
    ds = raw(["Question: Tom has 3 apples.\nAnswer:", "Question: Ann has 12 pens.\nAnswer:"],
             [" Tom has 3 apples.\n#### 3", " Ann has 12 pens.\n#### 12"])
    method = ARMethod(OmegaConf.structured(ARConfig), tokenizer)
    # words outside the synthetic vocabulary (Ann, pens, a, b) encode as <|unk|>: not what is tested
    tokenized = tokenize_dataset(ds, tokenizer, data_cfg(max_unk_rate=None))
    rows = method.build_train_dataset(tokenized, data_cfg(pack_length=128))
    assert len(rows) == 1
    batch = method.collate([rows[0]])
    with torch.no_grad():
        packed = forward_logits(model, batch)[0]
        start = 0
        for sample in tokenized:
            alone = model(torch.tensor([sample["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[start:start + sample["length"]], alone, rtol=1e-5, atol=1e-5)
            start += sample["length"]


def test_unpacked_rows_keep_one_sample_each(tokenizer):
    ds = raw(["a", "b"], [" 1", " 2"])
    # words outside the synthetic vocabulary (Ann, pens, a, b) encode as <|unk|>: not what is tested
    tokenized = tokenize_dataset(ds, tokenizer, data_cfg(max_unk_rate=None))
    rows = single_sample_rows(tokenized, ("input_ids",))
    assert [r["segment_ids"] for r in rows] == [[0] * r["length"] for r in rows]


# ---- bad inputs -------------------------------------------------------------------------------

def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl"):
        load_raw_split(data_cfg(source="files", train_files=[str(missing)]), "train")


def test_empty_file_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        load_raw_split(data_cfg(source="files", train_files=[str(empty)]), "train")


def test_empty_dataset_is_an_error(tmp_path):
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(DataError, match="empty"):
        load_raw_split(data_cfg(source="files", train_files=[str(f)], max_train_samples=0), "train")


def test_missing_column_is_named(tmp_path):
    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    with pytest.raises(DataError, match="'prompt'.*data.prompt_field"):
        load_raw_split(data_cfg(source="files", train_files=[str(f)]), "train")
    ds = load_raw_split(data_cfg(source="files", train_files=[str(f)], prompt_field="question",
                                 response_field="answer"), "train")
    assert ds[0]["prompt"] == "a" and ds[0]["response"] == "b"


def test_missing_mask_token_is_named(tokenizer):
    from pardec.common.constants import MASK_TOKEN
    from pardec.common.errors import ConfigError
    from pardec.models.loading import mask_token_id

    model = tiny_model(len(tokenizer))
    with pytest.raises(ConfigError, match="mask_token_id"):
        mask_token_id(model, tokenizer)
    model.config.pardec = {"mask_token_id": 5}
    with pytest.raises(ConfigError, match="mask token mismatch"):
        mask_token_id(model, tokenizer)
    assert MASK_TOKEN not in tokenizer.get_vocab()


def test_tokenizer_model_mismatch_is_named(tokenizer):
    from pardec.common.errors import CheckpointError
    from pardec.models.loading import check_tokenizer_matches

    model = tiny_model(10)
    with pytest.raises(CheckpointError, match=rf"tokenizer has {len(tokenizer)} tokens.*10 rows"):
        check_tokenizer_matches(model, tokenizer, "tiny")
