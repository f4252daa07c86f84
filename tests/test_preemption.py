"""Stop files and the preempted exit code: what scripts/slurm/train.sbatch relies on (tests/test_slurm.py runs it)."""

from __future__ import annotations

import subprocess
import sys

import torch

from pardec.trainers import trainer
from pardec.trainers.preemption import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER, STOP_FILE
from tests.train_utils import FAST, REPO, child_env, exported_weights, run_in_process

STAGES = "recipe.stages=[{name: a, max_steps: 2}, {name: b, max_steps: 4}]"


def test_root_stop_file_stops_the_running_stage_and_resume_matches(tmp_path, monkeypatch):
    """train.sbatch creates <output_dir>/STOP; a multi-stage recipe's stage must honour it, consume it,
    and the resumed recipe must end with the weights of an uninterrupted one."""
    straight = run_in_process([f"output_dir={tmp_path / 'straight'}", STAGES])
    out = tmp_path / "run"
    real_train_stage = trainer.train_stage

    def stop_requested_in_stage_b(cfg, dist_info, stop_dir=None):
        if cfg.output_dir.endswith("01-b"):
            (out / STOP_FILE).write_text("")
        return real_train_stage(cfg, dist_info, stop_dir)

    monkeypatch.setattr(trainer, "train_stage", stop_requested_in_stage_b)
    first = run_in_process([f"output_dir={out}", STAGES])
    assert first.status == "preempted" and first.step == 1
    assert (out / "stages" / "00-a" / "DONE").is_file()
    assert "stop file" in (out / "stages" / "01-b" / PREEMPTED_MARKER).read_text()
    assert (out / "stages" / "01-b" / "checkpoints" / "step-00000001").is_dir()
    assert not (out / STOP_FILE).exists(), "an honoured stop file must be consumed"

    monkeypatch.setattr(trainer, "train_stage", real_train_stage)
    second = run_in_process([f"output_dir={out}", STAGES])
    assert second.status == "finished" and second.step == 4
    a, b = exported_weights(straight.export_dir), exported_weights(second.export_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_stage_stop_file_is_consumed_too(tmp_path):
    stage_dir = tmp_path / "stages" / "00-a"
    stage_dir.mkdir(parents=True)
    (stage_dir / STOP_FILE).write_text("")
    result = run_in_process([f"output_dir={tmp_path}", STAGES])
    assert result.status == "preempted" and result.step == 1
    assert not (stage_dir / STOP_FILE).exists()


def test_preempted_train_exits_with_the_preempted_code(tmp_path):
    (tmp_path / STOP_FILE).write_text("")
    cmd = [sys.executable, "-m", "pardec.cli.train", *FAST, f"output_dir={tmp_path}", "trainer.max_steps=3"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "training preempted at step 1" in proc.stdout
    assert not (tmp_path / STOP_FILE).exists()


def test_launcher_exits_with_the_workers_exit_code(tmp_path):
    """torchrun exits 1 whenever a worker fails; pardec.cli.launch passes the workers' code on (75 = preempted)."""
    cmd = [sys.executable, "-m", "pardec.cli.launch", "--standalone", "--nproc_per_node", "2", "--no-python",
           "sh", "-c", f"exit {PREEMPTED_EXIT_CODE}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-2000:]
    ok = subprocess.run(cmd[:-1] + ["exit 0"], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                        check=False, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
