"""The synthetic generator's validation split: disjoint from train and test, and adding it left the
train and test splits byte-identical (digests measured on the generator before ``val`` existed)."""

from __future__ import annotations

import hashlib
import json

from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, extract_answer, generate_split

# sha256(json.dumps(rows, sort_keys=True)) of the default config's splits, computed before the val
# split was added (commit e662138).
DIGESTS_BEFORE_VAL = {
    "test": "2fd7588407924a5c491779524e7cf15a5426ac322d370a333b4eb4f8e2c3cb22",
    "train": "7104b7024a9f1dfcdb62f343f312a6048054cf2c020c91ac96b7a44668f6ad20",
}


def _digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def test_train_and_test_unchanged_and_val_disjoint() -> None:
    cfg = SyntheticGSMConfig()
    splits = {name: generate_split(cfg, name) for name in ("train", "test", "val")}
    for name, digest in DIGESTS_BEFORE_VAL.items():
        assert _digest(splits[name]) == digest, name
    val = [row["prompt"] for row in splits["val"]]
    assert len(val) == len(set(val)) == cfg.num_val
    assert not set(val) & {row["prompt"] for row in splits["train"]}
    assert not set(val) & {row["prompt"] for row in splits["test"]}
    assert all(extract_answer(row["response"]) == row["answer"] for row in splits["val"])
    assert generate_split(cfg, "val") == splits["val"]


def test_val_excludes_train_when_the_space_is_small() -> None:
    cfg = SyntheticGSMConfig(num_train=300, num_test=50, num_val=50, max_operand=3, max_value=9, min_steps=1,
                             max_steps=1, allow_multiply=False)
    prompts = {name: {row["prompt"] for row in generate_split(cfg, name)} for name in ("train", "test", "val")}
    assert len(prompts["val"]) == 50
    assert not prompts["val"] & (prompts["train"] | prompts["test"])
