"""Reliability (issue 12): checkpoints are never lost and settings are never silently ignored.

One test per cause, deterministic: faults are injected at an exact boundary of the save sequence
(``pardec.trainers.checkpoint._crash_point``) or of the training loop, never by killing at random.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from hydra.errors import MissingConfigException

from pardec.common.errors import CheckpointError, ConfigError, DataError
from pardec.trainers import checkpoint as ckpt
from pardec.trainers.config import resume_changes
from pardec.trainers.deepspeed_config import build_deepspeed_config
from pardec.trainers.run_lock import RunLock
from tests.train_utils import FAST, compose_train, exported_weights, run_in_process


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing on the way out handles it."""


def _kill_at(monkeypatch, point: str) -> None:
    def crash(name):
        if name == point:
            raise Killed(point)

    monkeypatch.setattr(ckpt, "_crash_point", crash)


def _steps(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / name).read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# the save sequence, with a stand-in engine (fast, every boundary)


class FakeEngine:
    def __init__(self, payload: str):
        self.payload = payload

    def save_checkpoint(self, root, tag, client_state, save_latest):
        path = Path(root) / tag
        path.mkdir(parents=True, exist_ok=True)
        (path / "mp_rank_00_model_states.pt").write_text(self.payload)


def _save(root: Path, step: int, payload: str, lineage: str, keep: int = 2) -> Path:
    return ckpt.save_training_state(FakeEngine(payload), root, step, {"step": step, "lineage": lineage}, 0, keep,
                                    "x: 1\n")


def _payload(path: Path) -> str:
    return (path / "mp_rank_00_model_states.pt").read_text()


@pytest.mark.parametrize("point", ["written", "moved_aside", "swapped", "latest_written", "old_deleted"])
def test_resave_of_a_step_killed_at_each_boundary_keeps_a_complete_checkpoint(tmp_path, monkeypatch, point):
    root = tmp_path / "checkpoints"
    _save(root, 2, "two", "L")
    _save(root, 4, "four", "L")
    _kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        _save(root, 4, "four-again", "L")
    monkeypatch.undo()
    plan = ckpt.plan_resume(tmp_path, "auto", "refuse")
    assert plan.path == root / "step-00000004" and plan.step == 4 and plan.lineage == "L"
    assert _payload(plan.path) in ("four", "four-again")  # the old or the new one, whole
    ckpt.verify_checksums(plan.path)
    assert ckpt.read_latest(root) == "step-00000004"
    assert not list(root.glob("*.old")) and not list(root.glob("*.tmp"))


def test_pruning_deletes_only_its_own_checkpoints(tmp_path):
    """An older run's higher step numbers (20, 22) are never pruned, nor does their presence get
    the new run's checkpoints pruned; latest always names an existing checkpoint."""
    root = tmp_path / "checkpoints"
    _save(root, 20, "old", "older-run")
    _save(root, 22, "old", "older-run")
    for step in (5, 7, 9):
        _save(root, step, "new", "this-run")
        assert (root / ckpt.read_latest(root) / ckpt.STATE_FILE).is_file()
    assert sorted(p.name for p in root.glob("step-*")) == [
        "step-00000007", "step-00000009", "step-00000020", "step-00000022"]
    assert ckpt.read_latest(root) == "step-00000009"


def test_save_over_another_runs_checkpoint_moves_it_aside(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 4, "theirs", "other-run")
    _save(root, 4, "ours", "this-run")
    assert _payload(root / "step-00000004") == "ours"
    (aside,) = root.glob("step-00000004.displaced-*")
    assert _payload(aside) == "theirs"


def test_dangling_latest_is_repaired_from_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 2, "two", "L")
    _save(root, 4, "four", "L")
    (root / "step-00000006.tmp").mkdir()  # an interrupted save: never a candidate
    (root / "latest").write_text("step-00000006")
    plan = ckpt.plan_resume(tmp_path, "auto", "refuse")
    assert plan.path == root / "step-00000004"
    assert any("REPAIRED" in n and "step-00000006" in n for n in plan.notes)
    assert ckpt.read_latest(root) == "step-00000004"


# ---------------------------------------------------------------------------------------------
# the trainer, end to end on the tiny default


def test_deleted_latest_resumes_from_newest_checkpoint_loudly(tmp_path, caplog):
    first = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=6", "trainer.save_every=2",
                            "trainer.stop_after_steps=4"])
    assert first.status == "stopped" and first.step == 4
    (tmp_path / "checkpoints" / "latest").unlink()
    with caplog.at_level(logging.WARNING):
        second = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=6", "trainer.save_every=2"])
    assert second.status == "finished" and second.step == 6
    assert "REPAIRED" in caplog.text and "step-00000004" in caplog.text
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    assert ckpt.read_latest(root) == "step-00000006"


def test_fresh_start_over_a_previous_run_refuses_then_archives(tmp_path):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])
    with pytest.raises(ConfigError) as err:
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2", "trainer.resume=never"])
    msg = str(err.value)
    assert str(tmp_path) in msg and "checkpoints/step-00000002" in msg and "trainer.on_existing=archive" in msg
    old = exported_weights(tmp_path / "hf")
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2", "trainer.resume=never",
                             "trainer.on_existing=archive", "trainer.lr=5e-3"])
    assert result.status == "finished" and result.step == 2
    (archived,) = (tmp_path / "archive").iterdir()
    assert (archived / "checkpoints" / "step-00000002" / ckpt.STATE_FILE).is_file()
    for name, tensor in exported_weights(archived / "hf").items():
        torch.testing.assert_close(tensor, old[name], rtol=0, atol=0)
    assert _steps(tmp_path) == [1, 2]


def test_resave_killed_midway_in_a_real_run_resumes(tmp_path, monkeypatch):
    """A resumed run killed while re-saving step 4 (old copy moved aside, new one not yet in place)."""
    straight = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=2",
                               "trainer.keep_checkpoints=3"])
    _kill_at(monkeypatch, "moved_aside")
    with pytest.raises(Killed):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=2",
                        "trainer.keep_checkpoints=3", f"trainer.resume={tmp_path}/checkpoints/step-00000002"])
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "step-00000004").exists()  # the kill left latest dangling
    resumed = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=2",
                              "trainer.keep_checkpoints=3"])
    assert resumed.status == "finished" and resumed.step == 4
    a, b = exported_weights(straight.export_dir), exported_weights(resumed.export_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_second_run_in_the_same_directory_is_refused_naming_the_holder(tmp_path):
    import os

    with RunLock(tmp_path), pytest.raises(CheckpointError) as err:
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])
    assert f'"pid": {os.getpid()}' in str(err.value) and str(tmp_path) in str(err.value)
    assert not (tmp_path / "config.yaml").exists()  # the refused run wrote nothing
    assert run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=1"]).status == "finished"  # released


def test_same_size_corruption_is_detected_by_checksum(tmp_path):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.stop_after_steps=2"])
    model_file = next((tmp_path / "checkpoints" / "step-00000002").glob("*model_states.pt"))
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{model_file.name}.*sha256"):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4"])


def test_resume_with_changed_settings_refuses_or_applies(tmp_path, caplog):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=3", "trainer.stop_after_steps=1"])
    with pytest.raises(ConfigError, match=r"trainer\.lr: 0\.001 -> 0\.01"):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=3", "trainer.lr=1e-2"])
    assert "lr: 0.001" in (tmp_path / "config.yaml").read_text()  # config.yaml still tells the truth
    with caplog.at_level(logging.WARNING):
        result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4"])
    assert result.status == "finished" and result.step == 4
    assert "trainer.max_steps: 3 -> 4" in caplog.text and "(applied)" in caplog.text


def test_raising_max_steps_on_a_finished_run_continues_it(tmp_path):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])
    again = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])
    assert again.status == "finished" and again.step == 2  # skipped, and says at which step
    more = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=3"])
    assert more.status == "finished" and more.step == 3
    assert _steps(tmp_path) == [1, 2, 3]
    assert (tmp_path / "DONE").read_text().strip() == "step 3"


def test_metrics_after_a_crash_are_not_repeated(tmp_path, monkeypatch):
    from pardec.methods.ar import ARMethod

    original, calls = ARMethod.loss, []

    def loss_crashing_in_step_4(self, model, batch):
        calls.append(1)
        if len(calls) == 4:
            raise Killed("step 4")
        return original(self, model, batch)

    monkeypatch.setattr(ARMethod, "loss", loss_crashing_in_step_4)
    with pytest.raises(Killed):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=2"])
    monkeypatch.undo()
    assert _steps(tmp_path) == [1, 2, 3]  # step 3 was logged after the step-2 checkpoint
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.save_every=2"])
    assert _steps(tmp_path) == [1, 2, 3, 4]
    assert _steps(tmp_path, "metrics.dropped.jsonl") == [3]


# ---------------------------------------------------------------------------------------------
# settings refused at start (composition and validation only: no training)


def test_deepspeed_extra_cannot_set_derived_keys():
    with pytest.raises(ConfigError) as err:
        compose_train(["+deepspeed.extra.gradient_accumulation_steps=4", "+deepspeed.extra.train_batch_size=8"])
    assert "'deepspeed.extra.gradient_accumulation_steps' (set trainer.grad_accum)" in str(err.value)
    assert "'deepspeed.extra.train_batch_size' (set trainer.micro_batch_size" in str(err.value)
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage.*deepspeed\.stage"):
        compose_train(["+deepspeed.extra.zero_optimization={stage: 3}"])


def test_deepspeed_extra_unknown_key_is_refused():
    with pytest.raises(ConfigError, match=r"deepspeed\.extra\.train_batch_sizee.*did you mean train_batch_size"):
        compose_train(["+deepspeed.extra.train_batch_sizee=8"])
    with pytest.raises(ConfigError, match="round_robin_gradientz"):
        compose_train(["deepspeed=zero2", "+deepspeed.extra.zero_optimization={round_robin_gradientz: true}"])


def test_deepspeed_extra_known_keys_are_merged():
    cfg = compose_train(["deepspeed=zero2", "+deepspeed.extra.zero_optimization={round_robin_gradients: true}",
                         "+deepspeed.extra.flops_profiler={enabled: false}"])
    ds = build_deepspeed_config(cfg, world_size=2, bf16=False)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["round_robin_gradients"] is True
    assert ds["flops_profiler"] == {"enabled": False}


def test_unknown_experiment_fails_naming_file_and_options():
    with pytest.raises(MissingConfigException) as err:
        compose_train(["experiment=idlm_defualt"])
    assert "experiment/idlm_defualt" in str(err.value) and "idlm_default" in str(err.value)


def test_model_config_typo_is_refused():
    with pytest.raises(ConfigError, match=r"model\.config\.hiden_size.*did you mean hidden_size"):
        compose_train(["+model.config.hiden_size=32"])
    compose_train(["+model.config.rope_theta=10000.0"])  # consumed by the config class: accepted


def test_stage_with_zero_steps_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"recipe\.stages\[1\]\.max_steps"):
        compose_train(["recipe.stages=[{name: a, max_steps: 2}, {name: b, max_steps: 0}]"])


def test_unknown_eval_decoder_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"eval\.decoder.*'foo'"):
        compose_train(["eval.decoder=foo"])


def test_betas_of_wrong_length_name_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.betas"):
        compose_train(["trainer.betas=[0.9]"])


def test_resume_changes_split_safe_and_unsafe_keys():
    saved = {"trainer": {"lr": 1e-3, "max_steps": 3, "log_every": 1}, "eval": {"every": 0}}
    new = {"trainer": {"lr": 1e-2, "max_steps": 5, "log_every": 2}, "eval": {"every": 1}}
    applied, refused = resume_changes(saved, new)
    assert refused == ["trainer.lr: 0.001 -> 0.01"]
    assert applied == ["eval.every: 0 -> 1", "trainer.log_every: 1 -> 2", "trainer.max_steps: 3 -> 5"]


def test_runs_saved_before_model_lora_existed_resume():
    """model.lora was added later: a saved config without it resumes when the key is at its default
    (full fine-tuning, the only behaviour then), and is refused when the resume would turn LoRA on."""
    saved = {"trainer": {"lr": 1e-3}, "model": {"path": "base"}}
    new = {"trainer": {"lr": 1e-3}, "model": {"path": "base", "lora": {
        "rank": None, "alpha": None, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}}
    assert resume_changes(saved, new) == ([], [])
    new["model"]["lora"]["rank"] = 8
    assert resume_changes(saved, new) == ([], ["model.lora.rank: '<unset>' -> 8"])


def test_runs_saved_with_the_removed_num_workers_key_resume():
    """trainer.num_workers never did anything and was removed (typing it now fails at start like any
    unknown key); a checkpoint whose saved config has it still resumes: its removal is a safe change."""
    applied, refused = resume_changes({"trainer": {"lr": 1e-3, "num_workers": 0}}, {"trainer": {"lr": 1e-3}})
    assert (applied, refused) == (["trainer.num_workers: 0 -> '<unset>'"], [])


def test_shutil_free_of_leftovers_after_prune(tmp_path):
    """Pruning renames to *.deleting first; a leftover from a kill is cleaned on the next start."""
    root = tmp_path / "checkpoints"
    _save(root, 2, "two", "L", keep=1)
    shutil.copytree(root / "step-00000002", root / "step-00000001.deleting")
    ckpt.plan_resume(tmp_path, "auto", "refuse")
    assert not list(root.glob("*.deleting"))


def test_multi_stage_raised_max_steps(tmp_path):
    """Finished stages: the last one continues to a raised max_steps; an earlier one refuses
    (its export already seeded the next stage)."""
    def stages(a: int, b: int) -> str:
        return f"recipe.stages=[{{name: a, max_steps: {a}}}, {{name: b, max_steps: {b}}}]"

    assert run_in_process([f"output_dir={tmp_path}", stages(1, 2)]).step == 2
    with pytest.raises(ConfigError, match=r"stage 0 .*finished at step 1.*later stages"):
        run_in_process([f"output_dir={tmp_path}", stages(2, 2)])
    result = run_in_process([f"output_dir={tmp_path}", stages(1, 3)])
    assert result.status == "finished" and result.step == 3
    assert _steps(tmp_path / "stages" / "01-b") == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# issue 40: a checkpoint is trusted only where it should be


def test_missing_checksums_of_a_run_that_records_them_is_refused(tmp_path):
    """checksums.json deleted (and a byte flipped): the resume refuses naming the missing file instead
    of loading unverified weights; a checkpoint from before checksums (no saved_at) is only warned about."""
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.stop_after_steps=2"])
    path = tmp_path / "checkpoints" / "step-00000002"
    (path / ckpt.CHECKSUM_FILE).unlink()
    model_file = next(path.glob("*model_states.pt"))
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path / ckpt.CHECKSUM_FILE} is missing"):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4"])

    legacy = _save(tmp_path / "legacy", 2, "two", "L")
    (legacy / ckpt.CHECKSUM_FILE).unlink()
    state = json.loads((legacy / ckpt.STATE_FILE).read_text())
    del state["saved_at"]
    (legacy / ckpt.STATE_FILE).write_text(json.dumps(state))
    ckpt.verify_checksums(legacy)  # written before checksums were recorded: not verified, not refused


def test_latest_pointing_out_of_the_run_is_refused(tmp_path):
    """latest edited to another run's checkpoint (a relative path out, or a link planted in
    checkpoints/) is refused naming the file and the value, never resumed."""
    mine, theirs = tmp_path / "mine" / "checkpoints", tmp_path / "theirs" / "checkpoints"
    _save(mine, 2, "mine", "M")
    _save(theirs, 8, "theirs", "T")
    escape = "../../theirs/checkpoints/step-00000008"
    (mine / "latest").write_text(escape)
    with pytest.raises(CheckpointError, match=rf"{mine / 'latest'} names '{re.escape(escape)}'"):
        ckpt.plan_resume(tmp_path / "mine", "auto", "refuse")
    (mine / "step-00000009").symlink_to(theirs / "step-00000008")
    (mine / "latest").write_text("step-00000009")
    with pytest.raises(CheckpointError, match=rf"{mine / 'latest'} names 'step-00000009'.*symbolic link"):
        ckpt.plan_resume(tmp_path / "mine", "auto", "refuse")
    (mine / "latest").unlink()  # repaired from this run's own checkpoints only, never the link
    assert ckpt.plan_resume(tmp_path / "mine", "auto", "refuse").path == mine / "step-00000002"


def _write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n" for r in rows))
    return path


def test_training_data_replaced_between_stop_and_resume_is_refused_or_announced(tmp_path, caplog):
    """The same data file path with other rows: the resume refuses naming the file and the tokenized
    set's change; trainer.allow_data_change=true continues and logs it."""
    from pardec.data_pipelines.sources import load_raw_split

    rows = load_raw_split(compose_train(FAST).data, "train")
    data = _write_rows(tmp_path / "train.jsonl", rows.select(range(16)))
    run = [f"output_dir={tmp_path / 'run'}", "data.source=files", f"data.train_files=[{data}]", "trainer.max_steps=4"]
    assert run_in_process([*run, "trainer.stop_after_steps=2"]).status == "stopped"
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / ckpt.STATE_FILE).read_text())
    assert state["fingerprint"]["data"]["files"][str(data)]["size"] == data.stat().st_size

    _write_rows(data, rows.select(range(16, 32)))
    with pytest.raises(DataError, match=rf"data file {re.escape(str(data))} changed.*tokenized training set changed"
                                        r".*trainer\.allow_data_change=true"):
        run_in_process(run)
    with caplog.at_level(logging.WARNING):
        assert run_in_process([*run, "trainer.allow_data_change=true"]).step == 4
    assert "trainer.allow_data_change=true: resuming" in caplog.text and str(data) in caplog.text


def test_fingerprint_names_a_changed_tokenizer_and_skips_old_checkpoints():
    from pardec.trainers.fingerprint import check_fingerprint, run_fingerprint, tokenizer_fingerprint
    from tests.conftest import data_cfg, tiny_tokenizer

    tokenized = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "prompt_len": [1, 1], "length": [3, 2]})
    tok = tiny_tokenizer()
    before = run_fingerprint(data_cfg(), tokenized, tokenizer_fingerprint(tok))
    tok.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    after = run_fingerprint(data_cfg(), tokenized, tokenizer_fingerprint(tok))
    with pytest.raises(DataError, match=r"the tokenizer changed \(24 -> 25 tokens"):
        check_fingerprint({"fingerprint": before}, after, False, "ckpt")
    assert check_fingerprint({"fingerprint": before}, before, False, "ckpt") == []
    assert "not compared" in check_fingerprint({}, after, False, "ckpt")[0]  # written before fingerprints
    dropped = run_fingerprint(data_cfg(), tokenized.select([0]), tokenizer_fingerprint(tok))
    with pytest.raises(DataError, match=r"tokenized training set changed \(2 -> 1 rows, 5 -> 3 tokens"):
        check_fingerprint({"fingerprint": after}, dropped, False, "ckpt")


# ---------------------------------------------------------------------------------------------
# issue 40: errors that came late or unnamed


@pytest.mark.parametrize("model", ["hf", "smollm2"])
def test_model_config_override_of_an_hf_model_names_the_key(tmp_path, model):
    """+model.config.<key> on an HF model failed inside Hydra (AssertionError: Unexpected type for root)."""
    with pytest.raises(ConfigError, match=r"'model.config.hidden_size', 'model.config.rope_scaling.factor' set with "
                                          r"model.path=.*a Hugging Face model's config comes from its checkpoint"):
        compose_train([f"model={model}", f"model.path={tmp_path}", "+model.config.hidden_size=64",
                       "+model.config.rope_scaling.factor=2"])
    assert compose_train(["model=hf", f"model.path={tmp_path}"]).model.config is None  # {} in the YAML = unset


def test_top_level_setting_every_stage_replaces_is_refused_and_a_partial_one_announced(tmp_path, caplog):
    """recipe=idlm trainer.max_steps=2 trained the stages' 200 + 200 + 400 steps: a command-line setting
    that every stage replaces is refused naming both keys (through the CLI too); one that only some
    stages replace is logged; values from the YAML defaults are not settings the user gave."""
    with pytest.raises(ConfigError, match=r"'trainer.max_steps' = 2 \(given on the command line\) is replaced in every "
                                          r"stage of recipe=idlm: recipe.stages\[0\].max_steps = 200, "
                                          r"recipe.stages\[1\].max_steps = 200, recipe.stages\[2\].max_steps = 400"):
        compose_train(["recipe=idlm", "trainer.max_steps=2"])
    with pytest.raises(ConfigError, match=r"'recipe.stride' = 3 .*recipe.stages\[2\].overrides.stride = 4"):
        compose_train(["recipe=idlm", "recipe.stride=3"])
    with caplog.at_level(logging.INFO):
        compose_train(["recipe=idlm", "recipe.stride=3",
                       "recipe.stages=[{name: a, max_steps: 1, overrides: {stride: 2}}, {name: b, max_steps: 1}]"])
    assert ("'recipe.stride' = 3 applies to stage(s) b; recipe.stages[0].overrides.stride = 2 replace(s) it"
            in caplog.text)
    compose_train(["recipe=idlm"])

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pardec.cli.train", "recipe=idlm", "trainer.max_steps=2",
                           f"output_dir={tmp_path}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "'trainer.max_steps' = 2 (given on the command line)" in proc.stderr
    assert not (tmp_path / "stages").exists()


def test_output_dir_naming_an_existing_file_is_refused_before_hydra(tmp_path, monkeypatch):
    from pardec.cli import train as train_cli

    existing = tmp_path / "notes.txt"
    existing.write_text("x")
    for override in (f"output_dir={existing}", f"++output_dir={existing}"):
        monkeypatch.setattr(sys, "argv", ["pardec-train", "experiment=default_base", override])
        with pytest.raises(SystemExit, match=f"output_dir={existing} is an existing file"):
            train_cli.main()
    train_cli.refuse_file_output_dir([f"output_dir={tmp_path}", f"output_dir={tmp_path / 'new'}"])  # no exit
