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
import logging
import re

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from pardec.common.errors import CheckpointError, ConfigError, DataError
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import check_prompt_unknown_rate, tokenize_dataset
from pardec.inference.checkpoint import load_checkpoint
from pardec.methods.ar import ARConfig, ARMethod
from pardec.methods.idlm import IDLMConfig, IDLMMethod
from pardec.methods.jacobi_forcing import JacobiForcingConfig, JacobiForcingMethod
from pardec.models.loading import check_max_positions, load_model, load_tokenizer
from pardec.trainers.config import ModelConfig
from tests.conftest import data_cfg, save_checkpoint, synthetic_tokenizer, tiny_model, tiny_tokenizer
from tests.train_utils import compose_train, run_in_process

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


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


# ---- 2. empty responses ----------------------------------------------------------------------

def test_empty_responses_are_counted_and_all_empty_is_refused(tokenizer, caplog):
    some = raw(["Question: Tom has 3 apples."] * 3, [" Tom has 3 apples.", "", "\n"])
    with caplog.at_level(logging.WARNING, logger="pardec.data_pipelines.tokenize"):
        out = tokenize_dataset(some, tokenizer, data_cfg())
    assert len(out) == 3
    assert "2 of 3 train responses are empty (first: row 1" in caplog.text
    none = raw(["Question: Tom has 3 apples."] * 2, ["", "\n"])
    with pytest.raises(DataError, match=r"every train response is empty \(2 rows, config key 'data.response_field'"):
        tokenize_dataset(none, tokenizer, data_cfg())
    # Methods whose targets are not the responses only get the warning.
    assert len(tokenize_dataset(none, tokenizer, data_cfg(), require_responses=False)) == 2
    assert ARMethod(OmegaConf.structured(ARConfig), tokenizer).trains_on_responses
    assert not ARMethod(OmegaConf.structured(ARConfig(train_on="all")), tokenizer).trains_on_responses
    jacobi = JacobiForcingMethod(OmegaConf.structured(JacobiForcingConfig(collect_dir="unused")), tokenizer)
    assert not jacobi.trains_on_responses


# ---- 3. unknown-token rate ---------------------------------------------------------------------

def test_unknown_token_rate_is_logged_and_limited(tokenizer, caplog):
    ascii_row = ("Question: Tom has 3 apples.", " Tom has 3 apples.")
    german = ("Frage: Jürgen hat 3 Äpfel.", " Jürgen hat 3 Äpfel.")
    ds = raw([ascii_row[0], german[0]], [ascii_row[1], german[1]])
    unk = tokenizer.unk_token_id
    unchecked = tokenize_dataset(ds, tokenizer, data_cfg(max_unk_rate=None))
    total = sum(unchecked["length"])  # every token of the split, EOS included
    n_unk = sum(t == unk for ids in unchecked["input_ids"] for t in ids)
    assert n_unk > 0.2 * total
    with pytest.raises(DataError) as err:
        tokenize_dataset(ds, tokenizer, data_cfg())
    message = str(err.value)
    assert message.startswith(f"train: {100 * n_unk / total:.2f}% of the tokens ({n_unk} of {total})")
    assert "first in row 1: 'Frage' in the prompt" in message and "data.max_unk_rate=0.01" in message
    # Under the threshold (or with the check off) the rate is still reported.
    with caplog.at_level(logging.INFO, logger="pardec.data_pipelines.tokenize"):
        assert len(tokenize_dataset(ds, tokenizer, data_cfg(max_unk_rate=None))) == 2
    assert f"train: {n_unk} of {total} tokens" in caplog.text and "first in row 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pardec.data_pipelines.tokenize"):
        tokenize_dataset(raw([ascii_row[0]], [ascii_row[1]]), tokenizer, data_cfg(), split="eval")
    assert "eval: 0 of " in caplog.text
    with pytest.raises(ConfigError, match=r"'data\.max_unk_rate' = 2\.0; expected in \[0, 1\]"):
        compose_train(["data.max_unk_rate=2.0"])  # its declared range, checked at start
    # Validation's eval split: its prompts, as decoding encodes them.
    with pytest.raises(DataError, match=r"^eval: .*first in row 1: 'Frage' in the prompt.*data.max_unk_rate=0.01"):
        check_prompt_unknown_rate(ds, tokenizer, data_cfg())


# ---- 4. positions beyond the base model's max_position_embeddings -------------------------------

def test_positions_beyond_the_model_are_refused_at_start(tmp_path, tokenizer):
    # The trainer refuses before tokenising or loading weights: max_length 2048 on a 512-position base.
    with pytest.raises(ConfigError, match=r"data.max_length=2048 .* up to 2047, but "
                                          r"model.config.max_position_embeddings = 512"):
        run_in_process([f"output_dir={tmp_path / 'run'}", "data.max_length=2048",
                        "model.config.max_position_embeddings=512"])
    assert not (tmp_path / "run" / "checkpoints").exists()
    # Positions, not slots: packed AR rows and I-DLM's [x_t | x_0] rows of 2L slots use positions < L.
    long_sample = tokenize_dataset(raw(["Question: Tom has 3 apples."], [" Tom has 3 apples."]), tokenizer, data_cfg())
    length = long_sample[0]["length"]
    cfg = data_cfg(max_length=length, pack_length=2 * length)
    ar = ARMethod(OmegaConf.structured(ARConfig), tokenizer)
    ar_rows = ar.build_train_dataset(datasets.concatenate_datasets([long_sample] * 2), cfg)
    assert max(max(r["position_ids"]) for r in ar_rows) + 1 == length == ar.max_positions(cfg)[0]
    idlm = IDLMMethod(OmegaConf.structured(IDLMConfig), tokenizer)
    idlm.mask_token_id = len(tokenizer)  # an id the samples do not contain (no model needed to collate)
    idlm.build_train_dataset(long_sample, cfg)
    batch = idlm.collate([long_sample[0]])
    assert batch["input_ids"].shape[1] == 2 * length
    assert int(batch["position_ids"].max()) + 1 == length == idlm.max_positions(cfg)[0]
    # Jacobi Forcing: a prompt (< max_length) and whole blocks of max_new_tokens; read from model.path.
    ck = save_checkpoint(tmp_path / "ck")  # max_position_embeddings=256
    jacobi = JacobiForcingMethod(
        OmegaConf.structured(JacobiForcingConfig(collect_dir="unused", block_size=16, max_new_tokens=40)), tokenizer
    )
    assert jacobi.max_positions(data_cfg(max_length=100))[0] == 99 + 48
    check_max_positions(model_cfg(path=str(ck)), *jacobi.max_positions(data_cfg(max_length=100)))
    with pytest.raises(ConfigError, match=rf"recipe.max_new_tokens=40 .* up to 256, but max_position_embeddings of "
                                          rf"{re.escape(str(ck / 'config.json'))} = 256"):
        check_max_positions(model_cfg(path=str(ck)), *jacobi.max_positions(data_cfg(max_length=210)))
    # A RoPE scaling extends the limit by its factor.
    scaled = {"model_type": "qwen3", "max_position_embeddings": 512,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}
    check_max_positions(model_cfg(config=scaled), 2048, "data.max_length=2048")


# ---- 5. checkpoint directories: tokenizer files, truncated weights -------------------------------

def test_checkpoint_without_tokenizer_or_with_truncated_weights_is_named(tmp_path, tokenizer):
    bare = tmp_path / "bare"
    tiny_model(len(tiny_tokenizer())).save_pretrained(bare)  # weights and config.json, no tokenizer
    expected = rf"no tokenizer files in {re.escape(str(bare))}: expected one of \['tokenizer.json'"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(bare)  # validation
    with pytest.raises(CheckpointError, match=rf"model.path={re.escape(str(bare))}: {expected}"):
        load_tokenizer(model_cfg(path=str(bare)), data_cfg())  # training
    # Truncated weights as model.path: named at start (position check) and by load_model.
    ck = save_checkpoint(tmp_path / "ck")
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    named = rf"model.path={re.escape(str(ck))}: corrupt or truncated weights file {re.escape(str(weights))}"
    with pytest.raises(CheckpointError, match=named):
        check_max_positions(model_cfg(path=str(ck)), 8, "data.max_length=8")
    with pytest.raises(CheckpointError, match=named):
        load_model(model_cfg(path=str(ck)), tiny_tokenizer(), torch.float32, "sdpa")


# ---- issue 40: errors that came late or unnamed -----------------------------------------------


def test_chat_template_missing_from_the_tokenizer_names_data_template_before_any_data_work(tmp_path):
    """data=jsonl (template chat) with the tiny model's tokenizer, which has no chat template: named
    at start (the train file does not even exist, so the check runs before any data is read)."""
    with pytest.raises(DataError, match=r"data.template=chat but the tokenizer has no chat template; set "
                                        r"data.template=plain"):
        run_in_process([f"output_dir={tmp_path}", "data=jsonl", f"data.train_files=[{tmp_path / 'absent.jsonl'}]",
                        "trainer.max_steps=1"])


def test_malformed_jsonl_names_the_line(tmp_path):
    """A missing comma on line 3, a line that is a list, and a .json document cut short: each named by
    file, line and column (the reader's own message gave a character position at best)."""
    good = json.dumps(GOOD)
    bad = tmp_path / "train.jsonl"
    bad.write_text(f"{good}\n{good}\n{good[:-1]}\n{good}\n")
    with pytest.raises(DataError, match=rf"could not read {re.escape(str(bad))}: line 3, column {len(good)}: "):
        load_raw_split(data_cfg(source="files", train_files=[str(bad)]), "train")
    bad.write_text(f"{good}\n\n[1, 2]\n")
    with pytest.raises(DataError, match=r"line 3: a JSON list, not an object"):
        load_raw_split(data_cfg(source="files", train_files=[str(bad)]), "train")
    doc = tmp_path / "train.json"
    doc.write_text(json.dumps([GOOD] * 3, indent=1)[:-3])
    with pytest.raises(DataError, match=r"train.json: line 1[0-9], column \d+: "):
        load_raw_split(data_cfg(source="files", train_files=[str(doc)]), "train")
