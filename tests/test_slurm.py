"""The Slurm templates (scripts/slurm/*.sbatch) under a real single-node Slurm, as a user runs them.

The module's fixture starts a cluster with ``scripts/slurm/local_cluster.sh`` (Debian's slurm-wlm and
munge, installed when missing; everything under a temporary directory) and stops it afterwards; the
tests skip, with the script's reason, where Slurm cannot be installed or started. Jobs run with tiny
configs on CPU, one thread each; the submitting environment carries SLURM_GPUS_ON_NODE=8 to check that
it does not leak into the jobs' processes-per-node.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pardec.trainers.preemption import PREEMPTED_MARKER, STOP_FILE
from tests.train_utils import FAST, REPO, exported_weights

pytestmark = pytest.mark.slurm

CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
UNAVAILABLE = 3  # local_cluster.sh: Slurm cannot be installed or started here
DIST_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
# Two stages; the second is long enough (hundreds of ~10 ms steps) for the signal to land inside it.
TRAIN = [*FAST, "trainer.log_every=1", "recipe.stages=[{name: a, max_steps: 3}, {name: b, max_steps: 400}]"]
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment for sbatch/squeue/scontrol against a fresh local cluster."""
    state = tmp_path_factory.mktemp("slurm-cluster")
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(SLURM_CONF=str(state / "slurm.conf"), PARDEC_PYTHON=sys.executable, OMP_NUM_THREADS="1",
               SLURM_GPUS_ON_NODE="8")
    env.pop("PARDEC_NPROC_PER_NODE", None)
    try:
        start = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, check=False,
                               timeout=900, stdin=subprocess.DEVNULL)
        if start.returncode == UNAVAILABLE:
            pytest.skip(f"no local Slurm cluster: {start.stderr.strip().splitlines()[-1]}")
        assert start.returncode == 0, f"local_cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield env
    finally:
        stop = subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, text=True, check=False,
                              timeout=120)
        assert stop.returncode == 0, f"local_cluster.sh stop failed:\n{stop.stdout}\n{stop.stderr}"


def sbatch(env: dict, workdir: Path, template: str, args: list[str], options: list[str] = (),
           extra_env: dict | None = None) -> str:
    """Submit from the repository root, as the templates require; the job log lands in ``workdir``."""
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", f"--chdir={workdir}",
           *options, str(REPO / "scripts" / "slurm" / template), *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**env, **(extra_env or {})}, capture_output=True, text=True, check=False,
                          timeout=60)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def job_info(env: dict, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, check=False,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def log_of(env: dict, job: str) -> str:
    path = Path(job_info(env, job).get("StdOut", ""))
    return path.read_text() if path.is_file() else f"(no log at {path})"


RELEASE_AFTER_S = 5.0


def wait_for(env: dict, job: str, states: set[str], timeout: float = JOB_TIMEOUT, release_requeued: bool = False):
    """Poll until the job is in one of ``states``. Slurm holds a requeued job for two minutes (BeginTime);
    ``release_requeued`` starts it at once (scontrol update StartTime=now) to keep the test short."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    held_since = None
    while time.monotonic() < deadline:
        info = job_info(env, job)
        if info.get("JobState") in states:
            return info
        if info.get("JobState") in {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
            break
        held = release_requeued and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
        held_since = (held_since or time.monotonic()) if held else None
        # Release only after a few seconds: started at once, the requeued job can race slurmd's cleanup of
        # the killed run and be refused ("Killing non-startable batch job: Job credential revoked").
        if held and time.monotonic() - held_since > RELEASE_AFTER_S:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=False, timeout=30)
            held_since = None
        time.sleep(0.5)
    raise AssertionError(f"job {job}: {info.get('JobState')} (wanted {sorted(states)}), "
                         f"exit {info.get('ExitCode')}; log:\n{log_of(env, job)[-6000:]}")


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory):
    """A plain, uninterrupted train.sbatch run (submitted here, waited for by its users)."""
    out = tmp_path_factory.mktemp("straight")
    job = sbatch(slurm, out, "train.sbatch", [*TRAIN, f"output_dir={out / 'run'}"])
    return job, out / "run"


def test_train_sbatch_preempted_in_second_stage_requeues_and_resumes_exactly(slurm, straight, tmp_path):
    run = tmp_path / "run"
    job = sbatch(slurm, tmp_path, "train.sbatch", [*TRAIN, f"output_dir={run}"])
    metrics = run / "stages" / "01-b" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline and job_info(slurm, job).get("JobState") in {"PENDING", "RUNNING"}, \
            f"stage b never ran:\n{log_of(slurm, job)[-6000:]}"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True, timeout=30)

    info = wait_for(slurm, job, {"COMPLETED"}, release_requeued=True)
    log = log_of(slurm, job)
    assert info["Restarts"] == "1", f"expected one requeue, got {info['Restarts']}; log:\n{log[-6000:]}"
    # one log for both runs (--open-mode=append): the preempted run's lines survive the requeue
    assert "restart 0" in log and "restart 1" in log, log[-6000:]
    preempted = re.search(r"training preempted at step (\d+)", log)
    assert preempted and 1 <= int(preempted.group(1)) < 400, log[-6000:]
    assert f"stop file {run / STOP_FILE}" in log  # the root STOP that train.sbatch touched, honoured by stage b
    assert "requeueing job" in log and re.search(r"already finished at step \d+; skipping", log)
    assert "training finished at step 400" in log and "exited with status 0" in log
    assert "1 process(es) per node" in log  # SLURM_GPUS_ON_NODE=8 from the submitting shell did not leak
    assert not (run / STOP_FILE).exists() and not (run / "stages" / "01-b" / PREEMPTED_MARKER).exists()

    straight_job, straight_run = straight
    wait_for(slurm, straight_job, {"COMPLETED"})
    assert "restart 1" not in log_of(slurm, straight_job)
    a = exported_weights(straight_run / "stages" / "01-b" / "hf")
    b = exported_weights(run / "stages" / "01-b" / "hf")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_validate_and_collect_sbatch_complete(slurm, straight, tmp_path):
    straight_job, straight_run = straight
    wait_for(slurm, straight_job, {"COMPLETED"})
    export = straight_run / "stages" / "01-b" / "hf"
    validate = sbatch(slurm, tmp_path, "validate.sbatch",
                      [f"checkpoint={export}", "data.max_eval_samples=4", "decoder.max_new_tokens=6",
                       f"output_dir={tmp_path / 'eval'}", "progress=false"],
                      extra_env={"PARDEC_NPROC_PER_NODE": "2"})
    collect = sbatch(slurm, tmp_path, "collect_trajectories.sbatch",
                     ["model=hf", f"model.path={export}", "data.max_train_samples=4", "recipe.block_size=4",
                      "recipe.max_new_tokens=8", "recipe.shard_size=2", f"output_dir={tmp_path / 'traj'}"])
    for job in (validate, collect):
        wait_for(slurm, job, {"COMPLETED"})
    validate_log, collect_log = log_of(slurm, validate), log_of(slurm, collect)
    assert "2 process(es) per node" in validate_log and "(2 process(es))" in validate_log, validate_log[-6000:]
    assert (tmp_path / "eval" / "metrics.json").is_file()
    assert "trajectories:" in collect_log, collect_log[-6000:]
    assert sorted(p.name for p in tmp_path.glob("slurm-*.out")) == \
        sorted([f"slurm-pardec-validate-{validate}.out", f"slurm-pardec-collect-{collect}.out"])
    from pardec.data_pipelines.jacobi_trajectories import load_trajectories

    assert len(load_trajectories(tmp_path / "traj" / "trajectories")) == 4


def test_train_sbatch_signal_before_training_requeues(slurm, tmp_path):
    """A USR1 in the first moments of the job (while the batch shell resolves the config) requeues it
    instead of killing the shell; the requeued job trains to the end."""
    job = sbatch(slurm, tmp_path, "train.sbatch", [*FAST, "trainer.max_steps=2", f"output_dir={tmp_path / 'run'}"])
    wait_for(slurm, job, {"RUNNING"})
    # RUNNING can come before slurmd has started the batch shell, and a signal sent then is lost (seen
    # once in CI: the job trained to the end unsignalled). The preamble's first line comes after the
    # trap is installed and before the config is resolved: signal once it is in the log.
    deadline = time.monotonic() + JOB_TIMEOUT
    while "pardec: job" not in log_of(slurm, job):
        assert time.monotonic() < deadline, f"the batch shell never started:\n{log_of(slurm, job)[-6000:]}"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True, timeout=30)
    info = wait_for(slurm, job, {"COMPLETED"}, release_requeued=True)
    log = log_of(slurm, job)
    assert info["Restarts"] == "1" and "restart 1" in log, log[-6000:]
    assert "SIGUSR1 before training started" in log, log[-6000:]
    assert "training finished at step 2" in log, log[-6000:]
