# bash scripts/reproduce.sh [--real]
#   (or: .venv/bin/python -m pardec.cli.reproduce [--real [--chunk-dir DIR [--chunk-steps NAME ...]]] [--only NAME ...]
#        [--dry-run])
"""Reproduce the summary table (docs/results/summary.md) on one machine: the embedded default base, each conversion
(I-DLM, R-ISD, Jacobi Forcing, ReFusion, MDM), each method's benchmark and the summary table.

``--real`` runs the real-model pipeline instead (docs/results/real_cpu.md): SmolLM2-135M-Instruct imported,
fine-tuned, converted, benchmarked on the 200 test problems and summarised in
``benchmarks/results/real/summary.md``; its state is ``runs/reproduce_real/`` and its steps use both cores
(``--threads``, default 2): with a 135M model two threads decode and train faster than one, and nothing
else runs beside a step. Its ISD and MDM tables (R-ISD, I-DLM, FlashDLM, COVER) decode in chunks kept under
``benchmarks/results/real/chunks/`` (committed; :mod:`pardec.benchmarks.chunks`), which a re-built
checkpoint of the same bytes goes on from; a base re-built on another kind of CPU has other bytes, the
benchmark refuses those chunks, and ``--chunk-dir DIR`` (e.g. ``runs/reproduce_real/chunks``) decodes
the tables anew with chunks kept under ``DIR``, leaving the committed ones as they are; ``--chunk-steps``
names the steps whose chunks move (all the chunked steps by default), so that a machine that re-builds one
conversion's committed bytes but not another's goes on from the first and decodes the second anew.

Steps run in order, each as its own process, with its output in ``runs/reproduce/logs/<step>.log``,
single-threaded (``OMP_NUM_THREADS=1``, benchmarks ``--threads 1``): on the 2-core machine torch's
two OpenMP threads ran the base's training at 1.3-1.6 s per step, against 0.1 s alone, whenever
anything else used a core; one thread per step keeps the times stable and leaves a core free.
The run is resumable: a training step is done when its run directory holds ``DONE`` (the trainer
itself resumes an interrupted run from its last checkpoint); a benchmark step is done when
``runs/reproduce/<step>.done`` records the same inputs (the ``DONE`` files of the runs it reads) and
the same command as now, so a re-trained conversion, or a benchmark whose arguments changed, is run
again. Wall time per step is printed and kept in ``runs/reproduce/steps.json``; the conversions' times
also in ``benchmarks/results/cpu_conversions.json`` (``benchmarks/results/real/`` for ``--real``),
committed with the results. Everything is relative to the working directory, the repository root when
started by ``scripts/reproduce.sh`` (it writes the repository's ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from pardec.benchmarks.chunks import REFUSED
from pardec.common.run_records import machine_description, set_entry

STATE = Path("runs/reproduce")
REAL_STATE = Path("runs/reproduce_real")
# Each pipeline's conversion wall times, kept with its results (runs/ may not outlive the machine);
# read by pardec.benchmarks.summary and real_summary. A conversion trained again replaces its entry.
CONVERSIONS = Path("benchmarks/results/cpu_conversions.json")
REAL_CONVERSIONS = Path("benchmarks/results/real/cpu_conversions.json")
PY = [sys.executable]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    # Training steps: the (last stage's) run directory whose DONE marks completion. Benchmarks: None.
    run_dir: str | None = None
    # Run directories whose DONE files a benchmark reads (a change re-runs it).
    inputs: tuple[str, ...] = ()


def train(experiment: str, final_stage: str | None = None, launcher: list[str] = PY) -> Step:
    """A conversion; a multi-stage recipe is done when its last stage (``stages/<final_stage>``) is."""
    run_dir = f"runs/{experiment}" + (f"/stages/{final_stage}" if final_stage else "")
    return Step(experiment, [*launcher, "-m", "pardec.cli.train", f"experiment={experiment}"], run_dir=run_dir)


def bench(name: str, args: list[str], inputs: tuple[str, ...], module: str | None = None) -> Step:
    """A step run when its inputs changed; ``module`` defaults to ``pardec.benchmarks.<name>``."""
    return Step(name, [*PY, "-m", module or f"pardec.benchmarks.{name}", *args], inputs=inputs)


BASE = "runs/default_base/hf"
IDLM = "runs/idlm_default/stages/03-stride4_more"
JACOBI = "runs/jacobi_forcing_default/stages/01-round2"
STEPS: tuple[Step, ...] = (
    train("default_base"),
    train("idlm_default", "03-stride4_more"),
    train("idlm_lora_default"),
    bench("idlm_isd", ["--base", BASE, "--idlm", f"{IDLM}/hf",
                       "--risd", "runs/idlm_lora_default/hf", "--threads", "1"],
          ("runs/default_base", IDLM, "runs/idlm_lora_default")),
    train("jacobi_forcing_default", "01-round2", TORCHRUN_2),
    bench("jacobi_forcing", ["--base", BASE, "--round1", "runs/jacobi_forcing_default/stages/00-round1/hf",
                             "--round2", f"{JACOBI}/hf", "--threads", "1"],
          ("runs/default_base", JACOBI)),
    train("refusion_default"),
    bench("refusion", ["--base", BASE, "--refusion", "runs/refusion_default/hf", "--block-sizes", "8", "16",
                       "--thresholds", "0.9", "0.7", "0.5", "0.3", "--threads", "1"],
          ("runs/default_base", "runs/refusion_default")),
    train("mdm_default"),
    bench("mdm_flashdlm", ["--base", BASE, "--mdm", "runs/mdm_default/hf", "--threads", "1"],
          ("runs/default_base", "runs/mdm_default")),
    bench("cover", ["--mdm", "runs/mdm_default/hf", "--threads", "1"], ("runs/mdm_default",)),
    bench("summary", [], ("runs/default_base", IDLM, "runs/idlm_lora_default", JACOBI, "runs/refusion_default",
                          "runs/mdm_default")),
)

SMOLLM2 = "runs/smollm2_sft"
REAL = "benchmarks/results/real"
REAL_CHUNKS = f"{REAL}/chunks"  # committed; --chunk-dir moves each step's chunk directory elsewhere
LOCAL_CHUNKS = "runs/reproduce_real/chunks"  # what a refused step suggests as --chunk-dir
# I-DLM with a rank-64 LoRA on the frozen base: 3 and 7.5 test points lost in two builds where full fine-tuning
# (smollm2_idlm, still an experiment) lost 19, at the same TPF (docs/results/real_cpu.md).
REAL_IDLM = "runs/smollm2_idlm_lora/stages/02-stride4"
# ReFusion with the same LoRA on five times the steps of smollm2_refusion_lora (itself 12 and 13 test points above
# full fine-tuning, smollm2_refusion), its rows padded to the longest (data.pad_to=longest), which keeps the 3000
# steps within the budget (44.8 min on an Intel Xeon, 56.2 on an AMD EPYC). On test b=8 with speculative completion
# answers 63.0% on the AMD EPYC's build (the base 65.5%; 600 steps: 54.5%) at TPF 2.93 and 1.84x the base's AR with the
# paper's first token, which val chose there (65.0% with the AR head's, token for token its own AR greedy; the Intel
# build: 67.5% at 2.85 and 1.65x with the AR head's), 2.16 and 1.65x with the paper's completion
# (docs/results/real_cpu.md).
REAL_REFUSION = "runs/smollm2_refusion_lora_3000"
# Jacobi Forcing with the same LoRA on five times the trajectories and steps of smollm2_jacobi_forcing_lora (itself
# 2.5 and 3.5 test points above full fine-tuning, smollm2_jacobi_forcing), its rows padded to the longest
# (data.pad_to=longest), which brought its training within the budget (30.6 min on an Intel Xeon, where rows of
# 512 slots paced 65; 32.8 min on an AMD EPYC, 72.6 with the trajectory collection). On test Jacobi n=16 (chosen on
# val) decodes the AMD build at TPF 2.69 and 1.54x the base's AR in chunks (1.57x its own), lossless, 3.5 points
# below the base. Three times the data (smollm2_jacobi_forcing_lora_long, the pipeline's from 2026-12-04 to
# 2026-12-06) reached TPF 1.55 at 1.32x (docs/results/real_cpu.md).
REAL_JACOBI = "runs/smollm2_jacobi_forcing_lora_1500/stages/00-round1"
# MDM with the same LoRA on 2000 steps, its rows padded to the longest (49.5 min on an Intel Xeon): on test its LLaDA
# baseline answers 58.5% (the base 65.5%; smollm2_mdm, 550 steps of full fine-tuning: 23.0%) and FreeCache runs at
# 3.42x the baseline's TPS (docs/results/real_cpu.md). The FlashDLM and COVER tables decode it.
REAL_MDM = "runs/smollm2_mdm_lora_2000"
# The same conversion in blocks of 8 (52.2 min on an AMD EPYC): its FlashDLM rows that the 6x goal names, beside
# the block-2 table. On test FreeCache + guided runs at 6.76x its baseline's TPS, while the baseline falls 29.5
# points below the base (block 2: 7) and FreeCache alone under 3x (docs/results/real_cpu.md, "The block-8 MDM in
# the pipeline").
REAL_MDM_BLOCK8 = "runs/smollm2_mdm_lora_2000_block8"
REAL_STEPS: tuple[Step, ...] = (
    bench("import", ["smollm2-135m-instruct"], (), module="pardec.cli.import_model"),
    train("smollm2_sft"),
    bench("smollm2_sft_eval", [f"checkpoint={SMOLLM2}/hf", "decoder=ar_greedy", "decoder.batch_size=16",
                               "decoder.max_new_tokens=96", "progress=false"], (SMOLLM2,),
          module="pardec.cli.validate"),
    bench("cpu_speed", ["--model", "models/smollm2-135m-instruct", "--out", f"{REAL}/cpu_speed"], (),
          module="pardec.benchmarks.real_model_speed"),
    train("smollm2_risd"),
    # AR and R-ISD on the 200 test problems in chunks of 10, both rows on each chunk in turn (so that a drift of the
    # machine's speed reaches both), resumed from the last finished chunk.
    bench("cpu_risd", ["--base", f"{SMOLLM2}/hf", "--risd", "runs/smollm2_risd/hf", "--threads", "2",
                       "--chunk-dir", f"{REAL_CHUNKS}/cpu_risd", "--chunk-size", "10",
                       "--out", f"{REAL}/cpu_risd"], (SMOLLM2, "runs/smollm2_risd"),
          module="pardec.benchmarks.idlm_isd"),
    train("smollm2_idlm_lora", "02-stride4"),
    # N chosen among 2-4 on 30 val problems (for TPS; the choice kept beside the chunks); the test rows at that N
    # and at N = 4, whose TPF the goal names (docs/results/real_cpu.md), whichever N val chooses, in chunks of 10.
    bench("cpu_idlm", ["--base", f"{SMOLLM2}/hf", "--idlm", f"{REAL_IDLM}/hf", "--strides", "2", "3", "4",
                       "--num-val", "30", "--test-strides", "4", "--no-sample", "--chunk-dir",
                       f"{REAL_CHUNKS}/cpu_idlm", "--chunk-size", "10",
                       "--threads", "2", "--out", f"{REAL}/cpu_idlm"], (SMOLLM2, REAL_IDLM),
          module="pardec.benchmarks.idlm_isd"),
    train("smollm2_refusion_lora_3000"),
    # Sized for the 2-core CPU (60.6 min in chunks on an AMD EPYC): (b, first token, tau) chosen on 30 val problems
    # at 96 new tokens among b = 8 (one slot: the paper's first token or the AR head's) and b = 16 (two slots, the
    # paper's), as the embedded default, every row completing speculatively (all of a slot's drafts; the sweep kept
    # beside the chunks); on the test problems both AR greedy rows, the chosen setting, its recomputation ablation,
    # (at b = k) the other first-token source and the paper's completion (one token per forward) only, in chunks of 10.
    bench("cpu_refusion", ["--base", f"{SMOLLM2}/hf", "--refusion", f"{REAL_REFUSION}/hf", "--num-val", "30",
                           "--block-sizes", "8", "16", "--first-tokens", "mask", "ar", "--thresholds", "0.9", "0.7",
                           "0.5", "--completion-drafts", "all", "--max-drop", "0.03", "--test-chosen-only",
                           "--ablations", "kv_reuse", "first_token", "completion_drafts", "--goal-drop", "0.03",
                           "--goal-reuse", "2", "--max-new-tokens", "96", "--chunk-dir", f"{REAL_CHUNKS}/cpu_refusion",
                           "--chunk-size", "10", "--threads", "2", "--out", f"{REAL}/cpu_refusion"],
          (SMOLLM2, REAL_REFUSION),
          module="pardec.benchmarks.refusion"),
    train("smollm2_jacobi_forcing_lora_1500", "00-round1"),
    # One round (the conversion's budget); n chosen among 4, 8, 16 on 30 val problems (for TPS; the choice kept beside
    # the chunks), no training-cost table (an embedded-default result); the test rows in chunks of 10.
    bench("cpu_jacobi_forcing", ["--base", f"{SMOLLM2}/hf", "--round1", f"{REAL_JACOBI}/hf", "--wide-block-size", "0",
                                 "--num-val", "30", "--val-block-sizes", "4", "8", "16", "--no-training-table",
                                 "--chunk-dir", f"{REAL_CHUNKS}/cpu_jacobi_forcing", "--chunk-size", "10",
                                 "--threads", "2", "--out", f"{REAL}/cpu_jacobi_forcing"],
          (SMOLLM2, REAL_JACOBI), module="pardec.benchmarks.jacobi_forcing"),
    train("smollm2_mdm_lora_2000"),
    # Sized for the 2-core CPU, where the LLaDA baseline, WINO, Saber and COVER run one full-sequence forward
    # (about 0.5 s) per step. The FlashDLM table on all 200 test problems, in chunks of 10 (every row on each
    # chunk in turn; a stopped run goes on from its last finished chunk): AR, the baseline, Fast-dLLM, FreeCache
    # (refresh), FreeCache + guided (assisted, strict) and guided shifted, 28-45 s per problem (1.5-2.5 h, by the
    # CPU and the conversion: docs/results/real_cpu.md); the
    # other rows (two tokens per step, freeze-at-last-step, relaxed) are in the GPU and embedded tables. The
    # COVER table likewise, with the base's AR greedy row (TPS / base AR), tau_draft on 5 val problems (2-5 min,
    # kept beside the chunks), about 42 s per problem (2.4 h on an Intel Xeon). The chunks are committed
    # (benchmarks/results/real/chunks/): a later session re-builds smollm2_sft and the MDM and goes on from them
    # when its checkpoints are the same bytes (the chunks name them by sha256; pardec.benchmarks.chunks).
    bench("cpu_mdm_flashdlm", ["--base", f"{SMOLLM2}/hf", "--mdm", f"{REAL_MDM}/hf", "--num-samples", "200",
                               "--rows", "ar,lowconf1,threshold,fc_refresh,fc_guided_strict,guided_shifted",
                               "--chunk-dir", f"{REAL_CHUNKS}/cpu_mdm_flashdlm", "--chunk-size", "10",
                               "--threads", "2", "--out", f"{REAL}/cpu_mdm_flashdlm"],
          (SMOLLM2, REAL_MDM), module="pardec.benchmarks.mdm_flashdlm"),
    bench("cpu_cover", ["--mdm", f"{REAL_MDM}/hf", "--base", f"{SMOLLM2}/hf", "--num-samples", "200",
                        "--num-validation", "5", "--chunk-dir", f"{REAL_CHUNKS}/cpu_cover",
                        "--chunk-size", "10", "--threads", "2", "--out", f"{REAL}/cpu_cover"],
          (SMOLLM2, REAL_MDM), module="pardec.benchmarks.cover"),
    train("smollm2_mdm_lora_2000_block8"),
    # The goal's rows only (AR, the baseline, FreeCache and FreeCache + guided), in blocks of 8 (the experiment's
    # recipe.block_size, the decoding block by default), about 26 s per problem (1.5 h on an AMD EPYC).
    bench("cpu_mdm_flashdlm_block8", ["--base", f"{SMOLLM2}/hf", "--mdm", f"{REAL_MDM_BLOCK8}/hf",
                                      "--num-samples", "200", "--rows", "ar,lowconf1,fc_refresh,fc_guided_strict",
                                      "--chunk-dir", f"{REAL_CHUNKS}/cpu_mdm_flashdlm_block8", "--chunk-size", "10",
                                      "--threads", "2", "--out", f"{REAL}/cpu_mdm_flashdlm_block8"],
          (SMOLLM2, REAL_MDM_BLOCK8), module="pardec.benchmarks.mdm_flashdlm"),
    # COVER's goal rows in blocks of 8 (AR, WINO, Saber, COVER, COVER without override; the baseline is in the
    # table above, on the same problems): tau_draft the fewest-steps one at least as accurate on 20 val problems
    # as the better of WINO and Saber (--select baselines: 11 min, kept beside the chunks), then 22 s per test
    # problem (83 min in all on an AMD EPYC family 25 model 17).
    bench("cpu_cover_block8", ["--mdm", f"{REAL_MDM_BLOCK8}/hf", "--base", f"{SMOLLM2}/hf", "--num-samples", "200",
                               "--num-validation", "20", "--select", "baselines",
                               "--rows", "ar,wino,saber,cover,cover_no_override",
                               "--chunk-dir", f"{REAL_CHUNKS}/cpu_cover_block8", "--chunk-size", "10",
                               "--threads", "2", "--out", f"{REAL}/cpu_cover_block8"],
          (SMOLLM2, REAL_MDM_BLOCK8), module="pardec.benchmarks.cover"),
    # Block-causal (smollm2_mdm) against bidirectional (smollm2_mdm_bidir) attention, chosen on val: the
    # same conversion budget, each decoded in its own block (2 and 32), the LLaDA baseline and Fast-dLLM
    # on the first 15 val problems (about 10 min each).
    train("smollm2_mdm"),
    train("smollm2_mdm_bidir"),
    *(bench(f"cpu_mdm_val_{short}", ["--base", f"{SMOLLM2}/hf", "--mdm", f"{run}/hf", "--split", "val",
                                     "--num-samples", "15", "--rows", "ar,lowconf1,threshold", "--threads", "2",
                                     "--out", f"{REAL}/cpu_mdm_val_{short}"], (SMOLLM2, run),
            module="pardec.benchmarks.mdm_flashdlm")
      for short, run in (("block", "runs/smollm2_mdm"), ("bidir", "runs/smollm2_mdm_bidir"))),
    bench("real_summary", [], (SMOLLM2, "runs/smollm2_risd", REAL_IDLM, REAL_REFUSION, REAL_JACOBI, REAL_MDM,
                               REAL_MDM_BLOCK8, "runs/smollm2_mdm", "runs/smollm2_mdm_bidir")),
)


def with_chunk_root(step: Step, root: str) -> Step:
    """``step`` with its ``--chunk-dir`` (where it has one) moved under ``root``, keeping the directory's
    name: ``benchmarks/results/real/chunks/cpu_cover`` -> ``<root>/cpu_cover``. The command changes, so a
    benchmark done with other chunks runs again."""
    command = list(step.command)
    for i, arg in enumerate(command[:-1]):
        if arg == "--chunk-dir":
            command[i + 1] = str(Path(root) / Path(command[i + 1]).name)
    return dataclasses.replace(step, command=command)


def chunk_dir_of(step: Step) -> str | None:
    return next((b for a, b in zip(step.command, step.command[1:]) if a == "--chunk-dir"), None)


def failure_message(step: Step, code: int, seconds: float, log_path: Path, attempt_start: int) -> str:
    """Why a step stopped and what to do. Running it again resumes it, except when its benchmark refused a
    chunk made by another setting (:data:`pardec.benchmarks.chunks.REFUSED` in the last 64 kB of this
    attempt's log, which starts at byte ``attempt_start``; the error's list of differences can be long):
    that refusal comes back at every run, so the message says how to decode anew."""
    chunk_dir = chunk_dir_of(step)
    if chunk_dir is None or REFUSED not in log_tail(log_path, size=1 << 16, start=attempt_start):
        return (f"step {step.name!r} failed with exit code {code} after {seconds:.0f} s; "
                f"see {log_path}; re-run the same command to resume")
    other = LOCAL_CHUNKS if not chunk_dir.startswith(LOCAL_CHUNKS) else "another directory"
    return (f"step {step.name!r} refused a chunk in {chunk_dir}: it was made by another setting (what differs "
            f"is at the end of {log_path}); where that is a checkpoint: one re-built on another kind of CPU has "
            f"other bytes than the one the committed chunks name (docs/results/real_cpu.md, 'The base on other "
            f"kinds of CPU'). "
            f"To decode the table anew on this machine's checkpoints, keeping those chunks, run the same command "
            f"with --chunk-dir {other} --chunk-steps {step.name} (and any other step refused so; hours on 2 cores), "
            f"or delete {chunk_dir} to start over there")


def inputs_digest(step: Step) -> str:
    """Digest of a benchmark's arguments (its command after the interpreter) and of the DONE files it
    reads; a missing one is an error (order is wrong)."""
    digest = hashlib.sha256("\0".join(step.command[1:]).encode() + b"\0\0")
    for run_dir in step.inputs:
        done = Path(run_dir) / "DONE"
        if not done.is_file():
            raise SystemExit(f"step {step.name!r} needs {done}, which does not exist: run the steps before it")
        digest.update(f"{run_dir}\0".encode() + done.read_bytes())
    return digest.hexdigest()


def is_done(step: Step, state: Path) -> bool:
    if step.run_dir is not None:
        return (Path(step.run_dir) / "DONE").is_file()
    marker = state / f"{step.name}.done"
    return marker.is_file() and marker.read_text().strip() == inputs_digest(step)


def mark_done(step: Step, state: Path) -> None:
    if step.run_dir is None:
        marker = state / f"{step.name}.done"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(inputs_digest(step) + "\n")
        tmp.replace(marker)


WARNING_HEADER = re.compile(r":\d+: \w*Warning: ")


def log_tail(path: Path, size: int = 4096, start: int = 0) -> str:
    """The last ``size`` bytes of a log after byte ``start``, "" when it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(start, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_line(path: Path) -> str:
    """The log's last progress line: Python warnings (a ``file:line: XWarning: ...`` header and the
    indented source line after it) are skipped, so a deprecation warning does not stand in for progress."""
    lines = log_tail(path).replace("\r", "\n").splitlines()
    last, after_warning = "", False
    for line in lines:
        if WARNING_HEADER.search(line):
            after_warning = True
        elif not (after_warning and line.startswith(" ")) and line.strip():
            last, after_warning = line.strip(), False
    return last[:150]


def run_step(step: Step, index: int, total: int, heartbeat_s: float, state: Path, threads: int) -> float:
    """Run one step; its time so far is kept in steps.json at every heartbeat, so an attempt that is
    killed (a session or job ending) still counts when a later invocation finishes the step."""
    log_path = state / "logs" / f"{step.name}.log"
    print(f"[{index}/{total}] {step.name}: {' '.join(step.command[1:])}  (log: {log_path})", flush=True)
    previous = step_times(state).get(step.name, {})
    earlier = previous.get("seconds", 0.0) if previous.get("finished") is None else 0.0  # unfinished attempts
    start = time.perf_counter()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            elapsed = time.perf_counter() - start
            record(state, step.name, earlier + elapsed, finished=False)
            print(f"    ... {step.name} {elapsed:6.0f} s | {last_line(log_path)}", flush=True)

    with log_path.open("a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(step.command)}\n")
        log.flush()
        attempt_start = log.tell()
        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            code = subprocess.call(step.command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        finally:
            stop.set()
            beater.join()
    seconds = earlier + time.perf_counter() - start
    record(state, step.name, seconds, finished=code == 0)
    if code != 0:
        raise SystemExit(failure_message(step, code, seconds, log_path, attempt_start))
    mark_done(step, state)
    return seconds


def step_times(state: Path) -> dict:
    path = state / "steps.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def record(state: Path, name: str, seconds: float, finished: bool) -> None:
    """Wall seconds of a step over all its attempts; ``finished`` is the time it completed, or null."""
    set_entry(state / "steps.json", name, {"seconds": round(seconds, 1),
                                           "finished": time.strftime("%Y-%m-%d %H:%M:%S") if finished else None})


def save_conversion_time(path: Path, name: str, seconds: float) -> None:
    """Record a finished conversion's wall seconds (all its attempts) in ``path`` with the machine, keeping
    the others."""
    set_entry(path, name, {"wall_seconds": round(seconds, 1), "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "machine": machine_description()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="the real-model pipeline (SmolLM2-135M-Instruct)")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="run just these steps (in pipeline order)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and whether each is done")
    parser.add_argument("--heartbeat", type=float, default=60.0, help="seconds between progress lines")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of every step (default: 1 for the embedded pipeline, 2 for --real)")
    parser.add_argument("--chunk-dir", metavar="DIR",
                        help=f"with --real: keep the chunked tables' chunks under DIR instead of {REAL_CHUNKS} (the "
                             f"committed ones), e.g. {LOCAL_CHUNKS} where those were made with other checkpoints")
    parser.add_argument("--chunk-steps", nargs="+", metavar="STEP",
                        help="with --chunk-dir: move only these steps' chunks (default: every chunked step's)")
    args = parser.parse_args(argv)
    if args.chunk_dir and not args.real:
        raise SystemExit("--chunk-dir is for --real (the embedded pipeline decodes no chunks)")
    if args.chunk_steps and not args.chunk_dir:
        raise SystemExit("--chunk-steps names the steps whose chunks --chunk-dir moves: give --chunk-dir too")
    all_steps, state, conversions = ((REAL_STEPS, REAL_STATE, REAL_CONVERSIONS) if args.real
                                     else (STEPS, STATE, CONVERSIONS))
    threads = args.threads or (2 if args.real else 1)
    names = [s.name for s in all_steps]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}; steps: {names}")
    chunked = [s.name for s in all_steps if chunk_dir_of(s)]
    not_chunked = sorted(set(args.chunk_steps or ()) - set(chunked))
    if not_chunked:
        raise SystemExit(f"--chunk-steps: {not_chunked} decode no chunks; chunked steps: {chunked}")
    moved = set(args.chunk_steps or chunked) if args.chunk_dir else set()
    steps = [with_chunk_root(s, args.chunk_dir) if s.name in moved else s
             for s in all_steps if not args.only or s.name in args.only]
    (state / "logs").mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        for i, step in enumerate(steps, 1):
            done = (step.run_dir or all((Path(d) / "DONE").is_file() for d in step.inputs)) and is_done(step, state)
            print(f"[{i}/{len(steps)}] {step.name:24s} {'done' if done else 'to run':7s} {' '.join(step.command[1:])}")
        return
    wall = time.perf_counter()
    for i, step in enumerate(steps, 1):
        if is_done(step, state):
            print(f"[{i}/{len(steps)}] {step.name}: done, skipped", flush=True)
            continue
        seconds = run_step(step, i, len(steps), args.heartbeat, state, threads)
        if step.run_dir is not None:
            save_conversion_time(conversions, step.name, seconds)
        print(f"[{i}/{len(steps)}] {step.name}: finished in {seconds / 60:.1f} min", flush=True)
    table = "benchmarks/results/real/summary.md" if args.real else "benchmarks/results/summary.md"
    print(f"all steps done ({(time.perf_counter() - wall) / 60:.1f} min this invocation; per-step times in "
          f"{state / 'steps.json'}).\nSummary table: {table} (plot: {table[:-3]}.png)")


if __name__ == "__main__":
    main()
