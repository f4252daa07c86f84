"""pardec/cli/reproduce.py: steps run in order, finished ones are skipped, a benchmark re-runs when a
run it reads was re-trained or its arguments changed, and a failed attempt's time counts toward the step's total."""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from pardec.cli import reproduce


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train = reproduce.Step("conv", py("import pathlib; d = pathlib.Path('runs/conv'); d.mkdir(parents=True); "
                                      "(d / 'DONE').write_text('step 3\\n')"), run_dir="runs/conv")
    bench = reproduce.Step("bench", py("import pathlib; p = pathlib.Path('calls'); "
                                       "p.write_text(p.read_text() + 'x' if p.exists() else 'x')"),
                           inputs=("runs/conv",))
    monkeypatch.setattr(reproduce, "STEPS", (train, bench))
    return tmp_path


def test_runs_in_order_then_skips_finished_steps(pipeline, capsys):
    reproduce.main(["--heartbeat", "0.05"])
    assert (pipeline / "runs/conv/DONE").is_file() and (pipeline / "calls").read_text() == "x"
    times = json.loads((pipeline / "runs/reproduce/steps.json").read_text())
    assert set(times) == {"conv", "bench"} and all(t["finished"] for t in times.values())
    reproduce.main([])
    assert (pipeline / "calls").read_text() == "x"  # nothing ran again
    assert capsys.readouterr().out.count("done, skipped") == 2


def test_benchmark_reruns_when_its_input_was_retrained(pipeline):
    reproduce.main([])
    (pipeline / "runs/conv/DONE").write_text("step 6\n")  # the conversion was trained further
    reproduce.main([])
    assert (pipeline / "calls").read_text() == "xx"


def test_benchmark_reruns_when_its_arguments_changed(pipeline, monkeypatch):
    reproduce.main([])
    train, bench = reproduce.STEPS
    changed = reproduce.Step("bench", [*bench.command, "--num-val", "30"], inputs=bench.inputs)
    monkeypatch.setattr(reproduce, "STEPS", (train, changed))
    reproduce.main([])
    assert (pipeline / "calls").read_text() == "xx"
    reproduce.main([])
    assert (pipeline / "calls").read_text() == "xx"  # the new command's marker is kept


def test_failed_attempt_counts_toward_the_step_time(pipeline, monkeypatch):
    failing = reproduce.Step("slow", py("import time, sys; time.sleep(0.3); sys.exit(3)"), run_dir="runs/slow")
    monkeypatch.setattr(reproduce, "STEPS", (failing,))
    with pytest.raises(SystemExit, match="exit code 3"):
        reproduce.main([])
    first = json.loads((pipeline / "runs/reproduce/steps.json").read_text())["slow"]
    assert first["finished"] is None and first["seconds"] >= 0.3
    finishing = reproduce.Step("slow", py("import pathlib; d = pathlib.Path('runs/slow'); d.mkdir(parents=True); "
                                          "(d / 'DONE').write_text('step 1\\n')"), run_dir="runs/slow")
    monkeypatch.setattr(reproduce, "STEPS", (finishing,))
    reproduce.main([])
    second = json.loads((pipeline / "runs/reproduce/steps.json").read_text())["slow"]
    assert second["finished"] and second["seconds"] >= first["seconds"]


def test_unknown_step_and_missing_input_are_named(pipeline, monkeypatch):
    with pytest.raises(SystemExit, match="unknown step"):
        reproduce.main(["--only", "nope"])
    with pytest.raises(SystemExit, match="runs/conv/DONE"):
        reproduce.main(["--only", "bench"])


def test_every_step_runs_a_module_that_exists():
    """Each step's ``-m`` target is importable (a module renamed under pardec/ would otherwise fail
    only when the pipeline reaches it, an hour in)."""
    import importlib.util

    modules = [s.command[i + 1] for s in (*reproduce.STEPS, *reproduce.REAL_STEPS)
               for i, arg in enumerate(s.command) if arg == "-m"]
    assert modules and all(m.startswith(("pardec.", "torch.")) for m in modules), modules
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, missing


def test_real_pipeline_keeps_its_own_state_and_runs_steps_on_two_threads(pipeline, monkeypatch):
    """--real runs REAL_STEPS with state in runs/reproduce_real (the embedded state is untouched) and
    OMP_NUM_THREADS=2 in each step unless --threads says otherwise."""
    step = reproduce.Step("threads", py("import os, pathlib; p = pathlib.Path('omp'); "
                                        "p.write_text(p.read_text() + os.environ['OMP_NUM_THREADS'] if p.exists() "
                                        "else os.environ['OMP_NUM_THREADS'])"))
    monkeypatch.setattr(reproduce, "REAL_STEPS", (step,))
    reproduce.main(["--real"])
    assert (pipeline / "omp").read_text() == "2"
    assert set(json.loads((pipeline / "runs/reproduce_real/steps.json").read_text())) == {"threads"}
    assert not (pipeline / "runs/reproduce/steps.json").exists()
    (pipeline / "runs/reproduce_real/threads.done").unlink()
    reproduce.main(["--real", "--threads", "1"])
    assert (pipeline / "omp").read_text() == "21"


@pytest.mark.parametrize("real", [False, True])
def test_conversions_keep_their_wall_time_with_the_results(pipeline, monkeypatch, real):
    """Each finished training step's wall seconds go to the pipeline's cpu_conversions.json under
    benchmarks/results/ (committed: runs/ may not outlive the machine), keeping other entries;
    benchmarks are not recorded."""
    train, bench = reproduce.STEPS
    monkeypatch.setattr(reproduce, "REAL_STEPS", (train, bench))
    path, state = ((reproduce.REAL_CONVERSIONS, "runs/reproduce_real") if real
                   else (reproduce.CONVERSIONS, "runs/reproduce"))
    path = pipeline / path
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"earlier": {"wall_seconds": 60.0, "finished": "2026-11-26 10:00:00"}}))
    reproduce.main(["--real"] if real else [])
    times = json.loads(path.read_text())
    assert set(times) == {"earlier", "conv"} and times["earlier"]["wall_seconds"] == 60.0
    assert times["conv"]["wall_seconds"] == json.loads((pipeline / state / "steps.json").read_text())[
        "conv"]["seconds"]
    assert times["conv"]["machine"] == reproduce.machine_description()
    other = reproduce.CONVERSIONS if real else reproduce.REAL_CONVERSIONS
    assert not (pipeline / other).exists()


def test_progress_line_skips_python_warnings(tmp_path):
    log = tmp_path / "step.log"
    warning = warnings.formatwarning("`past_key_values` is deprecated", FutureWarning, "/m/module.py", 1789,
                                     "return forward_call(*args, **kwargs)")
    log.write_text("Loading weights: 50%\rLoading weights: 100%\n" + warning + "\n")
    assert reproduce.last_line(log) == "Loading weights: 100%"
    log.write_text(log.read_text() + "step 10 loss 1.97\n")
    assert reproduce.last_line(log) == "step 10 loss 1.97"
    assert reproduce.last_line(tmp_path / "missing.log") == ""


def test_chunk_dir_moves_the_mdm_tables_chunks_and_is_for_real_only(pipeline, monkeypatch, capsys):
    """--real --chunk-dir DIR gives each chunked benchmark DIR/<its chunk directory's name>; the other steps'
    commands are unchanged; without --real it is refused."""
    chunked = [s for s in reproduce.REAL_STEPS if "--chunk-dir" in s.command]
    assert {s.name: reproduce.chunk_dir_of(s) for s in chunked} == {
        name: f"{reproduce.REAL_CHUNKS}/{name}"
        for name in ("cpu_risd", "cpu_idlm", "cpu_jacobi_forcing", "cpu_refusion", "cpu_mdm_flashdlm", "cpu_cover",
                     "cpu_mdm_flashdlm_block8", "cpu_cover_block8")}
    for step in reproduce.REAL_STEPS:
        moved = reproduce.with_chunk_root(step, "elsewhere/chunks")
        if step in chunked:
            old, new = reproduce.chunk_dir_of(step), reproduce.chunk_dir_of(moved)
            assert new == "elsewhere/chunks/" + old.rsplit("/", 1)[1]
            assert [a for a in moved.command if a != new] == [a for a in step.command if a != old]
        else:
            assert moved == step
    monkeypatch.setattr(reproduce, "REAL_STEPS", tuple(chunked))
    monkeypatch.setattr(reproduce, "inputs_digest", lambda step: "x")  # no DONE files in tmp_path
    reproduce.main(["--real", "--chunk-dir", "elsewhere/chunks", "--dry-run"])
    out = capsys.readouterr().out
    assert "--chunk-dir elsewhere/chunks/cpu_mdm_flashdlm" in out and "--chunk-dir elsewhere/chunks/cpu_cover" in out
    assert reproduce.REAL_CHUNKS not in out
    with pytest.raises(SystemExit, match="--chunk-dir is for --real"):
        reproduce.main(["--chunk-dir", "elsewhere/chunks"])


def test_chunk_steps_moves_only_the_named_steps_chunks(pipeline, monkeypatch, capsys):
    """--chunk-steps: --chunk-dir moves only the named steps' chunks (a machine that re-builds the block-8
    conversion's committed bytes but not the block-2 one's); a step that decodes no chunks, or the option
    without --chunk-dir, is refused by name."""
    monkeypatch.setattr(reproduce, "inputs_digest", lambda step: "x")  # no DONE files in tmp_path
    reproduce.main(["--real", "--chunk-dir", "elsewhere", "--chunk-steps", "cpu_cover", "cpu_mdm_flashdlm",
                    "--dry-run"])
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()}
    assert "--chunk-dir elsewhere/cpu_cover " in lines["cpu_cover"]
    assert "--chunk-dir elsewhere/cpu_mdm_flashdlm " in lines["cpu_mdm_flashdlm"]
    for name in ("cpu_mdm_flashdlm_block8", "cpu_cover_block8"):
        assert f"--chunk-dir {reproduce.REAL_CHUNKS}/{name} " in lines[name]
    with pytest.raises(SystemExit, match=r"--chunk-steps: \['cpu_mdm_val_block'\] decode no chunks"):
        reproduce.main(["--real", "--chunk-dir", "elsewhere", "--chunk-steps", "cpu_mdm_val_block", "cpu_cover"])
    with pytest.raises(SystemExit, match="give --chunk-dir too"):
        reproduce.main(["--real", "--chunk-steps", "cpu_cover"])


def test_a_refused_chunk_says_how_to_decode_anew(pipeline, monkeypatch):
    """A chunked step whose benchmark stopped on a chunk of another setting (the benchmark's own error, from
    pardec.benchmarks.chunks.read_chunk) is told to use --chunk-dir, not to re-run; any other failure, even
    after a refusal earlier in the same (appended) log, is told to re-run to resume."""
    from pardec.benchmarks import chunks

    chunk_dir = pipeline / "committed"
    chunk_dir.mkdir()
    # A long difference (as the rows' decoder configs can be): the refusal starts more than 4 kB before the end.
    (chunk_dir / "0000-0001.json").write_text(json.dumps({"fingerprint": {"rows": "a" * 9000}, "rows": {}}))
    refuse = py(f"from pardec.benchmarks import chunks; chunks.read_chunk(__import__('pathlib').Path("
                f"{str(chunk_dir / '0000-0001.json')!r}), {{'rows': 'b' * 9000}})")
    step = reproduce.Step("cpu_cover", [*refuse, "--chunk-dir", "committed"])
    monkeypatch.setattr(reproduce, "REAL_STEPS", (step,))
    with pytest.raises(SystemExit) as refused:
        reproduce.main(["--real"])
    message = str(refused.value)
    assert "refused a chunk in committed" in message and "aaa" not in message
    assert f"--chunk-dir {reproduce.LOCAL_CHUNKS} --chunk-steps cpu_cover" in message
    assert "re-run the same command to resume" not in message
    assert chunks.REFUSED in (pipeline / "runs/reproduce_real/logs/cpu_cover.log").read_text()
    with pytest.raises(SystemExit, match="--chunk-dir another directory"):
        reproduce.main(["--real", "--chunk-dir", reproduce.LOCAL_CHUNKS])
    monkeypatch.setattr(reproduce, "REAL_STEPS", (reproduce.Step("cpu_cover", [*py("raise SystemExit(3)"),
                                                                            "--chunk-dir", "committed"]),))
    with pytest.raises(SystemExit, match="exit code 3 .*re-run the same command to resume"):
        reproduce.main(["--real"])
