"""Bad data that must be named or noticed (reliability issue 12, "bad data"): one test per cause,
each on tiny inputs and deterministic.

1. a prompt/response field that is missing, null or not a string (jsonl, parquet, several files);
2. empty responses (counted; every one empty refused when the method trains on responses);
3. the unknown-token rate (logged per split; above ``data.max_unk_rate`` refused);
4. samples whose positions exceed the base model's ``max_position_embeddings`` (refused at start);
5. a checkpoint directory without tokenizer files, and a truncated ``model.safetensors`` given as
   ``model.path`` for training (one file check shared by training and validation).
"""

from __future__ import annotations

import json
import re

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from common.errors import DataError
from data_pipelines.config import DataConfig
from data_pipelines.sources import load_raw_split
from data_pipelines.synthetic_gsm import SyntheticGSMConfig
from data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer
from trainers.config import ModelConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_synthetic_tokenizer(SyntheticGSMConfig())


def data_cfg(**overrides):
    cfg = OmegaConf.structured(DataConfig)
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def model_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), overrides)


def raw(prompts, responses):
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- 1. field types, named by file, row and field ---------------------------------------------

GOOD = {"prompt": "Question: Tom has 3 apples.", "response": " Tom has 3 apples."}


@pytest.mark.parametrize(
    "bad, what",
    [
        ({"prompt": "Question:"}, "missing or null"),  # no response key
        ({"prompt": "Question:", "response": None}, "missing or null"),
        ({"prompt": "Question:", "response": 3}, r"3 \(type int\)"),
        ({"prompt": "Question:", "response": ["a", "b"]}, r"\['a', 'b'\] \(type list\)"),
    ],
    ids=["missing", "null", "number", "list"],
)
def test_bad_jsonl_field_names_file_row_and_field(tmp_path, bad, what):
    f = write_jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError, match=rf"{re.escape(str(f))}: row 2: field 'response' \(config key "
                                        rf"'data.response_field'\) is {what}"):
        load_raw_split(data_cfg(source="files", train_files=[str(f)]), "train")


def test_bad_parquet_columns_and_second_file_are_named(tmp_path):
    ints = tmp_path / "ints.parquet"
    datasets.Dataset.from_dict({"question": ["a", "b"], "answer": [1, 2]}).to_parquet(str(ints))
    cfg = data_cfg(source="files", train_files=[str(ints)], prompt_field="question", response_field="answer")
    with pytest.raises(DataError, match=rf"{re.escape(str(ints))}: row 0: field 'answer' \(config key "
                                        r"'data.response_field'\) is 1 \(type int\)"):
        load_raw_split(cfg, "train")
    lists = tmp_path / "lists.parquet"
    datasets.Dataset.from_dict({"prompt": [[1, 2]], "response": ["x"]}).to_parquet(str(lists))
    with pytest.raises(DataError, match=r"lists.parquet: row 0: field 'prompt' \(config key 'data.prompt_field'\)"):
        load_raw_split(data_cfg(source="files", train_files=[str(lists)]), "train")
    # Several files: the bad row is named in its own file, counted from that file's first row.
    first = write_jsonl(tmp_path / "a.jsonl", [GOOD] * 3)
    second = write_jsonl(tmp_path / "b.jsonl", [GOOD, {"prompt": "x", "response": None}])
    with pytest.raises(DataError, match=r"b.jsonl: row 1: field 'response'"):
        load_raw_split(data_cfg(source="files", train_files=[str(first), str(second)]), "train")
    # Empty strings are data, not errors; good files load and concatenate in order.
    ok = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "", "response": ""}])
    ds = load_raw_split(data_cfg(source="files", train_files=[str(first), str(ok)]), "train")
    assert ds["prompt"] == [GOOD["prompt"]] * 3 + [""]
