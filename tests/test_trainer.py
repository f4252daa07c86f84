"""Trainer behaviour in one process: learning, exact resume, HF export, corrupt checkpoints, preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pardec.common.errors import CheckpointError, ConfigError
from pardec.trainers.preemption import PREEMPTED_MARKER, STOP_FILE
from tests.train_utils import exported_weights, logged_metrics, run_in_process


def _losses(run_dir: Path) -> list[float]:
    return [m["loss_ar"] for m in logged_metrics(run_dir)]


def test_loss_decreases(tmp_path):
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=30", "trainer.lr=3e-3"])
    assert result.status == "finished" and result.step == 30
    losses = _losses(tmp_path)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_resume_is_exact(tmp_path):
    straight = run_in_process([f"output_dir={tmp_path / 'straight'}", "trainer.max_steps=4"])
    first = run_in_process([f"output_dir={tmp_path / 'resumed'}", "trainer.max_steps=4", "trainer.stop_after_steps=2"])
    assert first.status == "stopped" and first.step == 2
    assert not (tmp_path / "resumed" / "hf").exists()
    second = run_in_process([f"output_dir={tmp_path / 'resumed'}", "trainer.max_steps=4"])
    assert second.status == "finished" and second.step == 4
    a, b = exported_weights(straight.export_dir), exported_weights(second.export_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    # the resumed run logged steps 1-2 then 3-4: the data position continued, not restarted
    assert [m["step"] for m in logged_metrics(tmp_path / "resumed")] == [1, 2, 3, 4]


def test_export_reloads_in_plain_transformers(tmp_path):
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])
    model = AutoModelForCausalLM.from_pretrained(result.export_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(result.export_dir)
    ids = tokenizer("Question: Tom has 3 apples.", return_tensors="pt").input_ids
    weights = exported_weights(result.export_dir)
    assert all(t.numel() > 0 for t in weights.values())
    # reference: rebuild the same architecture and load the raw tensors by hand
    ref = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").eval()
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)  # tied head
    ref.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.config.pardec["recipe"] == "ar"


def test_corrupt_checkpoint_is_named(tmp_path):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4", "trainer.stop_after_steps=2"])
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    model_file = next(ckpt.glob("*model_states.pt"))
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="step-00000002"):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=4"])


def test_latest_pointing_nowhere_is_an_error(tmp_path):
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-00000009")
    with pytest.raises(CheckpointError, match="step-00000009"):
        run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2"])


def test_stop_file_checkpoints_and_resume_finishes(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / STOP_FILE).write_text("")
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=3"])
    assert result.status == "preempted" and result.step == 1
    assert (tmp_path / PREEMPTED_MARKER).is_file()
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()
    assert not (tmp_path / STOP_FILE).exists()  # consumed: the next run is not stopped by it
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=3"])
    assert result.status == "finished" and result.step == 3
    assert not (tmp_path / PREEMPTED_MARKER).exists()


def test_multi_stage_recipe_chains_exports(tmp_path):
    stages = "recipe.stages=[{name: a, max_steps: 2}, {name: b, max_steps: 3, overrides: {train_on: all}}]"
    result = run_in_process([f"output_dir={tmp_path}", stages])
    assert result.status == "finished" and result.step == 3
    assert (tmp_path / "stages" / "00-a" / "hf" / "model.safetensors").is_file()
    assert result.export_dir == tmp_path / "stages" / "01-b" / "hf"
    saved = (tmp_path / "stages" / "01-b" / "config.yaml").read_text()
    assert "train_on: all" in saved and str(tmp_path / "stages" / "00-a" / "hf") in saved


def test_unknown_stage_override_is_named(tmp_path):
    with pytest.raises(ValueError, match="recipe.not_a_key"):
        run_in_process([f"output_dir={tmp_path}", "recipe.stages=[{name: a, overrides: {not_a_key: 1}}]"])


def test_periodic_eval_logs_decoding_metrics(tmp_path):
    run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=2", "eval.every=1", "eval.at_end=true",
                    "eval.num_samples=3", "eval.max_new_tokens=6", "eval.batch_size=3"])
    records = logged_metrics(tmp_path)
    evals = [r for r in records if "eval/tpf" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all(r["eval/num_samples"] == 3 and r["eval/tpf"] == 1.0 for r in evals)
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)


def test_sigusr1_checkpoints_and_exits(tmp_path, monkeypatch):
    """A real signal delivered mid-step (as Slurm's --signal does) stops at the step boundary."""
    import os
    import signal

    from pardec.methods.ar import ARMethod

    original = ARMethod.loss
    sent = []

    def loss_then_signal(self, model, batch):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(self, model, batch)

    monkeypatch.setattr(ARMethod, "loss", loss_then_signal)
    previous = signal.getsignal(signal.SIGUSR1)
    result = run_in_process([f"output_dir={tmp_path}", "trainer.max_steps=5"])
    assert result.status == "preempted" and result.step == 1
    assert "SIGUSR1" in (tmp_path / PREEMPTED_MARKER).read_text()
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()
    assert signal.getsignal(signal.SIGUSR1) == previous  # handlers restored


def test_eval_decoder_that_cannot_decode_the_recipes_export_is_refused_before_training(tmp_path):
    """recipe=mdm exports a bidirectional MDM: evaluating it with AR greedy is refused at start (naming
    eval.decoder and both checkpoint kinds); an MDM decoder evaluates the model in training as exported."""
    mdm = [f"output_dir={tmp_path}", "recipe=mdm", "model=tiny_qwen3", "trainer.max_steps=1", "eval.at_end=true",
           "eval.num_samples=2", "eval.max_new_tokens=32"]
    with pytest.raises(ConfigError, match=r"'eval.decoder' = 'ar': decoder 'ar' decodes checkpoints of kind ar or "
                                          r"masked-ar, but this run's export \(recipe=mdm\) is a checkpoint of kind "
                                          r"mdm-bidirectional"):
        run_in_process([*mdm, "eval.decoder=ar"])
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained
    run_in_process([*mdm, "eval.decoder=mdm_lowconf"])
    (record,) = [m for m in logged_metrics(tmp_path) if "eval/tpf" in m]
    assert record["eval/num_samples"] == 2
