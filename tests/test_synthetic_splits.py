"""The synthetic generator's validation and fresh splits: val disjoint from train and test, each fresh
split disjoint from all three, and adding them left the earlier splits byte-identical (digests measured
on the generator before each existed)."""

from __future__ import annotations

import hashlib
import json

import pytest

from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, extract_answer, generate_split

# sha256(json.dumps(rows, sort_keys=True)) of the default config's splits, computed before the val
# split was added (commit e662138).
DIGESTS_BEFORE_VAL = {
    "test": "2fd7588407924a5c491779524e7cf15a5426ac322d370a333b4eb4f8e2c3cb22",
    "train": "7104b7024a9f1dfcdb62f343f312a6048054cf2c020c91ac96b7a44668f6ad20",
}

# The same of the val split, computed before the fresh splits were added (commit fe40b13).
VAL_DIGEST_BEFORE_FRESH = "355502d248296cc50e0e2b99e80d5464ef8a2a743f88f5943aa6bcfefb8e39da"


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


def test_fresh_splits_are_new_problems_and_changed_no_other_split() -> None:
    cfg = SyntheticGSMConfig(num_fresh=100)
    splits = {name: generate_split(cfg, name) for name in ("train", "test", "val", "fresh1", "fresh2")}
    for name, digest in {**DIGESTS_BEFORE_VAL, "val": VAL_DIGEST_BEFORE_FRESH}.items():
        assert _digest(splits[name]) == digest, name
    earlier = {row["prompt"] for name in ("train", "test", "val") for row in splits[name]}
    for name in ("fresh1", "fresh2"):
        prompts = [row["prompt"] for row in splits[name]]
        assert len(prompts) == len(set(prompts)) == 100
        assert earlier.isdisjoint(prompts), name
        assert all(extract_answer(row["response"]) == row["answer"] for row in splits[name])
    assert splits["fresh1"] != splits["fresh2"]  # each from its own seed
    assert generate_split(cfg, "fresh1") == splits["fresh1"]  # deterministic
    # The first k problems do not depend on how many are drawn (a benchmark's --num-samples).
    assert generate_split(SyntheticGSMConfig(num_fresh=10), "fresh1") == splits["fresh1"][:10]


@pytest.mark.parametrize("name", ["fresh", "fresh0", "fresh-1", "fresh01", "Fresh1", "holdout"])
def test_a_malformed_split_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="fresh<k>"):
        generate_split(SyntheticGSMConfig(num_fresh=1), name)
