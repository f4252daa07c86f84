"""Evaluation core, validate config, and ``pardec/cli/validate.py`` (1 process and torchrun 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import pardec.cli.validate  # noqa: F401  (registers the validate_schema config node)
from pardec.common.attention import COMPILED_FLEX_BACKEND
from pardec.common.errors import ConfigError, DataError
from pardec.inference.config import validate_validate_config
from pardec.inference.evaluate import encode_prompt, evaluate, evaluate_model
from tests.conftest import EVAL_ROWS, save_checkpoint, tiny_model, tiny_tokenizer, write_eval_jsonl
from tests.train_utils import TORCHRUN_2

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TIMING_KEYS = {"tps", "decode_time_s"}


@pytest.fixture(scope="module")
def tok_model():
    tok = tiny_tokenizer()
    return tok, tiny_model(len(tok))


def eval_set(rows=EVAL_ROWS) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def test_evaluate_model_decodes_a_flex_model_with_sdpa(tok_model, flex_called):
    """In-training evaluation gets the training model, loaded with FlexAttention on GPU (compiled for
    every new shape): it decodes with SDPA (the same metrics as an SDPA model) and hands the model back
    with FlexAttention."""
    tok, _ = tok_model
    model = tiny_model(len(tok))
    decoder = {"name": "ar", "max_new_tokens": 6, "batch_size": 3}
    expected = evaluate_model(model, tok, eval_set(), decoder, agreement=False)
    model.set_attn_implementation(COMPILED_FLEX_BACKEND)
    got = evaluate_model(model, tok, eval_set(), decoder, agreement=False)
    assert {k: v for k, v in got.items() if k not in TIMING_KEYS} == {
        k: v for k, v in expected.items() if k not in TIMING_KEYS}
    assert model.config._attn_implementation == COMPILED_FLEX_BACKEND
    with pytest.raises(flex_called):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_evaluate_model_ar_greedy_in_memory(tok_model):
    tok, model = tok_model
    model.train()
    metrics = evaluate_model(model, tok, eval_set(), {"name": "ar", "max_new_tokens": 6, "batch_size": 3})
    assert model.training  # mode restored
    assert metrics["num_samples"] == len(EVAL_ROWS) and metrics["tpf"] == 1.0
    assert metrics["accuracy_n"] == len(EVAL_ROWS)
    assert metrics["agreement_exact"] == "reference"
    model.eval()


def test_evaluate_sampling_measures_agreement_against_ar_greedy(tok_model):
    tok, model = tok_model
    cold = evaluate(model, tok, eval_set(), {"name": "ar", "greedy": False, "temperature": 1e-4, "max_new_tokens": 6})
    assert cold.metrics["agreement_exact"] == 1.0 and cold.metrics["agreement_prefix"] == 1.0
    assert all(r["reference_ids"] == r["output_ids"] for r in cold.records)
    hot = evaluate_model(model, tok, eval_set(), {"name": "ar", "greedy": False, "temperature": 5.0,
                                                  "max_new_tokens": 6})
    assert hot["agreement_exact"] < 1.0
    off = evaluate_model(model, tok, eval_set(), {"name": "ar", "greedy": False, "max_new_tokens": 2}, agreement=False)
    assert off["agreement_exact"] is None


def test_a_split_decoded_in_parts_from_first_index_draws_what_one_call_draws(tok_model):
    """``first_index`` numbers a part's problems (records and sampling seeds) as in one call over the whole
    set: hot sampling decoded in two parts gives every problem the tokens one call gives it; numbered from 0
    instead, the second part draws other tokens."""
    tok, model = tok_model
    rows = eval_set()
    hot = {"name": "ar", "greedy": False, "temperature": 5.0, "max_new_tokens": 6, "batch_size": 1}
    whole = evaluate(model, tok, rows, hot, agreement=False).records
    cut = len(rows) // 2
    parts = [*evaluate(model, tok, rows.select(range(cut)), hot, agreement=False).records,
             *evaluate(model, tok, rows.select(range(cut, len(rows))), hot, agreement=False, first_index=cut).records]
    assert [(r["index"], r["output_ids"]) for r in parts] == [(r["index"], r["output_ids"]) for r in whole]
    from_zero = evaluate(model, tok, rows.select(range(cut, len(rows))), hot, agreement=False).records
    assert [r["output_ids"] for r in from_zero] != [r["output_ids"] for r in whole[cut:]]


def test_answer_scoring_uses_answer_column_or_response(tok_model):
    tok, model = tok_model
    rows = [{"prompt": "Question: what is 1 plus 2 ? Answer:", "response": "#### 3"}]
    [record] = evaluate(model, tok, eval_set(rows), {"name": "ar", "max_new_tokens": 2}).records
    assert record["answer"] == "3" and record["correct"] is False


def test_prompt_formatting_bos_and_empty_prompt():
    tok = tiny_tokenizer()
    plain = encode_prompt(tok, "what is 1", "plain", add_bos=False, index=0)
    assert plain == tok("what is 1", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, "what is 1", "plain", add_bos=True, index=0) == [tok.bos_token_id] + plain
    with pytest.raises(DataError, match="eval sample 5 has an empty prompt"):
        encode_prompt(tok, "", "plain", add_bos=False, index=5)


def test_chat_template_prompt():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}Question: {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}Answer:{% endif %}")
    ids = encode_prompt(tok, "what is 1", "chat", add_bos=True, index=0)
    assert ids == tok("Question: what is 1 Answer:", add_special_tokens=False)["input_ids"]


def test_chat_template_without_one_is_a_data_error(tok_model):
    tok, model = tok_model
    with pytest.raises(DataError, match="data.template=chat"):
        evaluate_model(model, tok, eval_set(), {"name": "ar"}, template="chat")


def compose_validate(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "pardec" / "recipes"), version_base="1.3"):
        return compose("validate", overrides=overrides)


def test_validate_config_defaults_and_errors():
    cfg = validate_validate_config(compose_validate(["checkpoint=/x", "decoder=ar_sample"]))
    assert cfg.decoder.name == "ar" and cfg.decoder.greedy is False and cfg.data.source == "synthetic"
    with pytest.raises(ConfigError, match="'checkpoint' is required"):
        validate_validate_config(compose_validate([]))
    with pytest.raises(ConfigError, match="decoder.temprature"):
        validate_validate_config(compose_validate(["checkpoint=/x", "+decoder.temprature=1"]))
    with pytest.raises(ConfigError, match="attn_implementation"):
        validate_validate_config(compose_validate(["checkpoint=/x", "attn_implementation=flashy"]))
    with pytest.raises(ConfigCompositionException, match="dtyp"):
        compose_validate(["checkpoint=/x", "dtyp=float32"])
    with pytest.raises(ConfigError, match="dtyp"):
        validate_validate_config(compose_validate(["checkpoint=/x", "+dtyp=float32"]))
    with pytest.raises(ConfigError, match="data.sourc"):
        validate_validate_config(compose_validate(["checkpoint=/x", "+data.sourc=files"]))


def run_validate(launcher: list[str], ck: Path, data: Path, out: Path, cwd: Path, extra: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = launcher + [
        "-m", "pardec.cli.validate", f"checkpoint={ck}", "data.source=files", f"data.eval_files=[{data}]",
        f"output_dir={out}", "progress=false", *extra,
    ]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def read_outputs(out: Path) -> tuple[dict, list[dict]]:
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return metrics, samples


def test_validate_cli_single_process(tmp_path):
    ck = save_checkpoint(tmp_path / "ck")
    data = write_eval_jsonl(tmp_path / "eval.jsonl")
    run_validate([sys.executable], ck, data, tmp_path / "out", tmp_path, ["decoder.max_new_tokens=5"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.json", "metrics.md", "samples.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "eval.jsonl", "out"]  # no Hydra clutter
    metrics, samples = read_outputs(tmp_path / "out")
    assert metrics["tpf"] == 1.0 and [s["index"] for s in samples] == list(range(len(EVAL_ROWS)))
    assert "| tpf | 1.0000 |" in (tmp_path / "out" / "metrics.md").read_text()


def test_validate_cli_missing_checkpoint_is_a_clear_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pardec.cli.validate", f"checkpoint={tmp_path / 'nope'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0 and f"checkpoint directory not found: {tmp_path / 'nope'}" in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_validate_two_processes_match_one(tmp_path):
    ck = save_checkpoint(tmp_path / "ck")
    data = write_eval_jsonl(tmp_path / "eval.jsonl")
    extra = ["decoder=ar_sample", "decoder.max_new_tokens=6", "decoder.batch_size=2"]
    run_validate([sys.executable], ck, data, tmp_path / "one", tmp_path, extra)
    run_validate(TORCHRUN_2, ck, data, tmp_path / "two", tmp_path, extra)
    (m1, s1), (m2, s2) = read_outputs(tmp_path / "one"), read_outputs(tmp_path / "two")
    assert {r["rank"] for r in s2} == {0, 1}
    drop = {"rank", "wall_time_s"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in s1] == [
        {k: v for k, v in r.items() if k not in drop} for r in s2
    ]
    assert ({k: v for k, v in m1.items() if k not in TIMING_KEYS}
            == {k: v for k, v in m2.items() if k not in TIMING_KEYS})
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["world_size"] == 2


def test_in_training_evaluation_never_emits_the_mask_token(monkeypatch):
    """evaluate_model (the trainer's hook) forbids a converted model's <|mask|> as an export load
    does, for the evaluation only: a mask logit built to win every argmax never reaches the output,
    and the model's own forward is untouched afterwards."""
    import pardec.inference.evaluate as evaluation
    from pardec.common.metadata import CheckpointMetadata

    tok = tiny_tokenizer(extra_tokens=("<|mask|>",))
    model = tiny_model(len(tok))
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    CheckpointMetadata(recipe="idlm", mask_token_id=mask_id).write_to(model)

    def dominate(module, args, output):
        output.logits[..., mask_id] += 1e4
        return output

    model.register_forward_hook(dominate)
    decoder = {"name": "ar", "max_new_tokens": 5}
    plain = evaluate(model, tok, eval_set(), decoder, agreement=False)
    assert all(set(r["output_ids"]) == {mask_id} for r in plain.records)  # the mask row really dominates
    seen = []

    def spy(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        seen.extend(result.records)
        return result

    monkeypatch.setattr(evaluation, "evaluate", spy)
    evaluate_model(model, tok, eval_set(), decoder, agreement=False)
    assert len(seen) == len(EVAL_ROWS) and all(mask_id not in r["output_ids"] for r in seen)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 4]])).logits
    assert int(logits[0, -1].argmax()) == mask_id  # the hook is gone after the evaluation


def _validate_cli(cwd: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pardec.cli.validate", "progress=false", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_validate_output_path_that_is_a_file_is_refused_before_any_work(tmp_path):
    """Issue 40: an output_dir that is an existing file failed after decoding everything. It is now
    refused at start: with a checkpoint that does not even exist, the output path is what is named.
    A path below a file, and an output file name taken by a directory, are refused too."""
    from pardec.cli.validate import check_output_dir

    blocker = tmp_path / "results"
    blocker.write_text("keep")
    proc = _validate_cli(tmp_path, [f"checkpoint={tmp_path / 'absent'}", f"output_dir={blocker}"])
    assert proc.returncode != 0 and f"config key 'output_dir' = {blocker}: {blocker} is an existing file" in proc.stderr
    assert blocker.read_text() == "keep"
    with pytest.raises(ConfigError, match=f"'output_dir' = {blocker / 'sub'}: {blocker} is an existing file"):
        check_output_dir(blocker / "sub", True)
    (tmp_path / "out" / "samples.jsonl").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"default output directory .*out/samples.jsonl is a directory"):
        check_output_dir(tmp_path / "out", False)
    check_output_dir(tmp_path / "new" / "dir", True)  # to be created: fine


def test_validate_ar_greedy_on_a_bidirectional_mdm_export_is_refused(tmp_path):
    """Issue 40: decoder=ar_greedy on an MDM export decoded and reported 0% accuracy."""
    from pardec.common.metadata import CheckpointMetadata

    tok = tiny_tokenizer(("<|mask|>",))
    model = tiny_model(len(tok))
    CheckpointMetadata(recipe="mdm", attention="bidirectional", logit_shift=True,
                       mask_token_id=tok.convert_tokens_to_ids("<|mask|>")).write_to(model)
    model.save_pretrained(tmp_path / "mdm")
    tok.save_pretrained(tmp_path / "mdm")
    data = write_eval_jsonl(tmp_path / "eval.jsonl")
    proc = _validate_cli(tmp_path, [f"checkpoint={tmp_path / 'mdm'}", "decoder=ar_greedy", "data.source=files",
                                    f"data.eval_files=[{data}]", f"output_dir={tmp_path / 'out'}"])
    assert proc.returncode != 0, proc.stdout
    assert "decoder 'ar' decodes checkpoints of kind ar or masked-ar" in proc.stderr
    assert "kind mdm-bidirectional" in proc.stderr and not (tmp_path / "out").exists()
