"""pardec.benchmarks.real_summary: rows read from the real-model benchmarks' JSON, wall times from the
CPU reproduce run and the GPU runs' file (and the GPU script's merge into it, and its run in a fresh clone),
rows not yet measured listed with their command, and a lossless claim shown as verified only at a measured
100% identity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pardec.benchmarks import real_summary


def bench_row(decoder: str, identical: float, tpf: float, ratio: float) -> dict:
    return {"decoder": decoder, "accuracy": 0.7, "identical_to_base": identical, "identical_to_own_ar": identical,
            "tpf": tpf, "num_samples": 200, "tps": 10.0 * ratio, "tps_ratio": ratio}


@pytest.fixture
def folders(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "cpu_conversions.json").write_text(json.dumps({  # smollm2_sft has no entry: never finished
        "smollm2_risd": {"wall_seconds": 3000.0, "finished": "2026-11-26 18:50:00"}}))
    (results / "gpu_conversions_h100.json").write_text(json.dumps({"smollm2_risd_gpu": {"wall_seconds": 229}}))
    return results


def test_measured_rows_missing_rows_and_wall_times(folders, tmp_path):
    results = folders
    (results / "cpu_risd.json").write_text(json.dumps([
        bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row("R-ISD N=3 greedy (gated LoRA)", 1.0, 2.4, 1.5)]))
    real_summary.main(["--results-dir", str(results), "--out-dir", str(tmp_path / "out"),
                       "--embedded", str(tmp_path / "absent.json")])
    table = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["method"], r["hardware"], r["gpu"]) for r in table] == [
        ("AR", real_summary.CPU, False), ("R-ISD", real_summary.CPU, False)]
    risd = table[1]
    assert risd["lossless_verified"] and risd["tps_ratio"] == 1.5 and risd["conversion_seconds"] == 3000.0
    assert table[0]["conversion_seconds"] is None  # the SFT step has no recorded time
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| 200 | 70.0% |" in md and "50.0 min" in md
    assert "Not measured yet:" in md and "(H100): `PROBLEMS=30 bash scripts/real_model_gpu.sh" in md
    assert (tmp_path / "out" / "summary.png").stat().st_size > 0


def test_cpu_conversion_machines_are_named_below_the_table(folders):
    assert real_summary.cpu_machines(folders) is None  # no entry names its machine
    epyc = "AMD EPYC (family 26, model 2), 2 cores"
    path = folders / "cpu_conversions.json"
    entries = json.loads(path.read_text())
    entries["smollm2_sft"] = {"wall_seconds": 800.0, "machine": epyc}
    entries["smollm2_refusion_lora_3000"] = {"wall_seconds": 2700.0, "machine": epyc}
    entries["smollm2_idlm"] = {"wall_seconds": 1900.0, "machine": "Xeon, 2 cores"}  # on record, no row decodes it
    path.write_text(json.dumps(entries))
    assert real_summary.cpu_machines(folders) == (
        "CPU conversion wall times were measured on: not recorded: `smollm2_risd`; "
        f"{epyc}: `smollm2_sft`, `smollm2_refusion_lora_3000`.")


def test_a_cpu_rows_hardware_is_the_cpu_its_table_ran_on(folders):
    """TPS ratios move with the kind of CPU, so each CPU row names its table's CPU from machines.json; a
    table it has no entry for keeps the generic name, and a GPU table's row its GPU."""
    xeon = "Intel Xeon (family 6, model 207), 2 cores"
    for name in ("cpu_risd", "gpu_risd_h100"):
        (folders / f"{name}.json").write_text(json.dumps([
            bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row("R-ISD N=3 greedy (gated LoRA)", 1.0, 2.4, 1.5)]))
    machines = {"cpu_risd": {"cpu": xeon, "gpu": None}, "gpu_risd_h100": {"cpu": "Xeon, 64 cores", "gpu": "H100"}}
    (folders / "machines.json").write_text(json.dumps(machines))
    table, _ = real_summary.build(folders, {})
    assert [(r["source"], r["hardware"], r["gpu"]) for r in table] == [
        ("cpu_risd", xeon, False), ("cpu_risd", xeon, False),
        ("gpu_risd_h100", real_summary.H100, True), ("gpu_risd_h100", real_summary.H100, True)]
    assert f"| R-ISD | gated LoRA on the CPU SFT base | R-ISD N=3 greedy (gated LoRA) | {xeon} |" in (
        real_summary.markdown(table, []))
    del machines["cpu_risd"]  # a table from before machines.json was written
    (folders / "machines.json").write_text(json.dumps(machines))
    table, _ = real_summary.build(folders, {})
    assert [r["hardware"] for r in table if not r["gpu"]] == [real_summary.CPU, real_summary.CPU]


def test_a_claim_below_100_percent_is_not_verified(folders, tmp_path):
    results = folders
    (results / "gpu_risd_h100.json").write_text(json.dumps([
        bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row("R-ISD N=3 greedy (gated LoRA)", 0.95, 2.8, 1.0)]))
    table, missing = real_summary.build(results, real_summary.conversion_seconds(results))
    risd = table[1]
    assert not risd["lossless_verified"] and risd["lossless"] == "claimed (= base AR) but 95.0% identical"
    assert risd["conversion_seconds"] == 229  # read as smollm2_risd_gpu@h100
    assert [r.source for r in missing] == ["cpu_risd", "cpu_risd", "cpu_idlm", "cpu_jacobi_forcing",
                                           "cpu_jacobi_forcing", "cpu_refusion", *["cpu_mdm_flashdlm"] * 5,
                                           *["cpu_cover"] * 3, *["cpu_mdm_flashdlm_block8"] * 3,
                                           *["cpu_cover_block8"] * 3,
                                           "gpu_idlm_isd_graphs_h200",
                                           "gpu_idlm_isd_graphs_h200", "gpu_refusion_graphs_h200",
                                           *["gpu_mdm_flashdlm_graphs_h200"] * 5,
                                           *["gpu_mdm_flashdlm_bidir_h200"] * 4, *["gpu_cover_bidir_h200"] * 3,
                                           *["gpu_cover_block32_h200"] * 3, *["gpu_jacobi_forcing_graphs_h200"] * 2]


def test_the_block8_mdm_table_gives_the_goal_rows_it_decodes(folders):
    """The block-8 MDM table decodes only the 6x goal's rows (AR, the baseline, FreeCache, FreeCache + guided):
    those three are in the summary, marked block 8 and timed with the block-8 conversion; Fast-dLLM and guided
    shifted, which it does not decode, are neither rows nor listed as missing."""
    labels = ["AR greedy (base)", "MDM low-confidence, 1 token/step (baseline)",
              "FreeCache (refresh), low-confidence 1/step", "FreeCache + guided (assisted, strict)"]
    (folders / "cpu_mdm_flashdlm_block8.json").write_text(json.dumps(  # the FlashDLM table's name for TPS / base AR
        [{**bench_row(label, 0.5, 1.0 + i, 0.0), "tps_vs_base_ar": 2.0 * i} for i, label in enumerate(labels)]))
    entries = json.loads((folders / "cpu_conversions.json").read_text())
    entries["smollm2_mdm_lora_2000_block8"] = {"wall_seconds": 3133.0}
    table, missing = real_summary.build(folders, real_summary.conversion_seconds(folders))
    block8 = [r for r in table if r["source"] == "cpu_mdm_flashdlm_block8"]
    assert [(r["decoder"], r["tps_ratio"]) for r in block8] == [(label, 2.0 * i) for i, label in enumerate(labels)][1:]
    assert [r["short"] for r in block8] == ["LLaDA 1/step, block 8", "FreeCache, block 8", "FreeCache+guided, block 8"]
    assert {(r["checkpoint"], r["conversion"], r["conversion_seconds"], r["lossless"]) for r in block8} == {
        (real_summary.MDM_BLOCK8_CPU_CHECKPOINT, "smollm2_mdm_lora_2000_block8", None, "no")}
    assert "cpu_mdm_flashdlm_block8" not in {r.source for r in missing}
    (folders / "cpu_conversions.json").write_text(json.dumps(entries))
    table, _ = real_summary.build(folders, real_summary.conversion_seconds(folders))
    assert {r["conversion_seconds"] for r in table if r["source"] == "cpu_mdm_flashdlm_block8"} == {3133.0}


def test_no_results_and_a_missing_row_are_named(folders, tmp_path):
    results = folders
    with pytest.raises(SystemExit, match="reproduce.sh --real"):
        real_summary.main(["--results-dir", str(results), "--out-dir", str(tmp_path)])
    (results / "cpu_risd.json").write_text(json.dumps([bench_row("AR greedy (base)", 1.0, 1.0, 1.0)]))
    with pytest.raises(SystemExit, match="no row 'R-ISD N=3 greedy"):
        real_summary.build(results, {})


def refusion_json(results: Path, chosen: str, first_token: str, threshold: float, rows: list[dict]) -> None:
    (results / "cpu_refusion.json").write_text(json.dumps({
        "chosen_label": chosen, "chosen_first_token": first_token, "chosen_threshold": threshold, "test": rows}))


def test_refusion_row_is_the_setting_chosen_on_validation(folders):
    """The ReFusion benchmark's JSON is a dict: its test rows, and the label of the setting it chose on
    val; with the paper's first token the row makes no lossless claim, and "= own AR" may be absent
    (--no-own-ar)."""
    results = folders
    chosen, other = "ReFusion b=16 tau=0.7 first_token=mask", "ReFusion b=16 tau=0.5 first_token=mask"
    rows = [bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row(other, 0.2, 3.1, 2.0),
            bench_row(chosen, 0.3, 2.6, 1.8)]
    for row in rows:
        row["identical_to_own_ar"] = None
    refusion_json(results, chosen, "mask", 0.7, rows)
    table, _ = real_summary.build(results, {})
    (refusion,) = [r for r in table if r["method"] == "ReFusion"]
    assert (refusion["decoder"], refusion["tpf"], refusion["tps_ratio"]) == (chosen, 2.6, 1.8)
    assert refusion["lossless"] == "no" and not refusion["lossless_verified"]


@pytest.mark.parametrize("threshold, own_identity, lossless", [
    (0.7, 1.0, "yes (= own AR)"),  # the AR head's first token at tau >= 0.5: own AR greedy by construction
    (0.7, 0.9, "claimed (= own AR) but 90.0% identical"),  # a claim is verified only by the measurement
    (0.3, 0.9, "no"),  # below 0.5 an accepted token need not be the argmax: no claim
])
def test_refusion_with_the_ar_heads_first_token_claims_its_own_ar(folders, threshold, own_identity, lossless):
    results = folders
    chosen = f"ReFusion b=8 tau={threshold:g} first_token=ar"
    row = bench_row(chosen, 0.4, 2.6, 1.5)
    row["identical_to_own_ar"] = own_identity
    refusion_json(results, chosen, "ar", threshold, [bench_row("AR greedy (base)", 1.0, 1.0, 1.0), row])
    table, _ = real_summary.build(results, {})
    (refusion,) = [r for r in table if r["method"] == "ReFusion"]
    assert refusion["lossless"] == lossless and refusion["lossless_verified"] == (lossless == "yes (= own AR)")


def test_isd_and_jacobi_rows_are_at_the_n_chosen_on_validation(folders):
    """idlm_isd --num-val and jacobi_forcing --num-val write dicts: the test rows and what val chose."""
    results = folders
    isd = [bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row("AR greedy (I-DLM ckpt)", 0.5, 1.0, 1.0),
           bench_row("ISD N=3 greedy", 0.5, 2.4, 1.6)]
    (results / "cpu_idlm.json").write_text(json.dumps({"chosen_stride": 3, "validation": [], "test": isd}))
    jacobi, multiblock = "Jacobi n=4 (round 1, trained at n=8)", "Multi-block + recycling n=4 K=2 (round 1)"
    decoding = [bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row(jacobi, 0.6, 1.3, 1.1),
                bench_row(multiblock, 0.6, 1.4, 1.05)]
    (results / "cpu_jacobi_forcing.json").write_text(json.dumps({
        "decoding": decoding, "chosen_block_size": 4, "chosen_labels": {"jacobi": jacobi, "multiblock": multiblock}}))
    table, missing = real_summary.build(results, {})
    rows = {(r["method"], r["decoder"]): r for r in table}
    assert rows[("I-DLM", "ISD N=3 greedy")]["tpf"] == 2.4 and rows[("I-DLM", "ISD N=3 greedy")]["short"] == "ISD N=3"
    assert ([rows[("Jacobi Forcing", label)]["short"] for label in (jacobi, multiblock)]
            == ["Jacobi n=4", "multi-block n=4"])
    assert rows[("Jacobi Forcing", jacobi)]["tps_ratio"] == 1.1 and rows[("Jacobi Forcing", multiblock)]["tpf"] == 1.4
    assert "cpu_idlm" not in {r.source for r in missing} and "cpu_jacobi_forcing" not in {r.source for r in missing}


@pytest.mark.parametrize("chosen, test_strides, decoders", [
    (3, [3, 4], ["ISD N=3 greedy", "ISD N=4 greedy"]),  # val chose 3: the goal's N=4 is a second row
    (4, [4], ["ISD N=4 greedy"]),  # val chose the goal's N: one row
    (3, None, ["ISD N=3 greedy"]),  # a table from before --test-strides: the chosen row alone
])
def test_isd_at_the_goal_stride_is_a_second_row_where_val_chose_another(folders, chosen, test_strides, decoders):
    results = folders
    isd = [bench_row("AR greedy (base)", 1.0, 1.0, 1.0), bench_row("AR greedy (I-DLM ckpt)", 0.5, 1.0, 1.0),
           *(bench_row(f"ISD N={n} greedy", 0.5, 1.0 + n / 2, 1.5) for n in sorted({chosen, *(test_strides or [])}))]
    data = {"chosen_stride": chosen, "validation": [], "test": isd}
    if test_strides is not None:
        data["test_strides"] = test_strides
    (results / "cpu_idlm.json").write_text(json.dumps(data))
    table, missing = real_summary.build(results, {})
    rows = [r for r in table if r["method"] == "I-DLM"]
    assert [r["decoder"] for r in rows] == decoders
    assert [r["short"] for r in rows] == [d.removesuffix(" greedy") for d in decoders]
    assert [r["tpf"] for r in rows] == [1.0 + int(d[6]) / 2 for d in decoders]
    assert "cpu_idlm" not in {r.source for r in missing}


def test_a_missing_chosen_row_is_listed_by_its_short_name(folders):
    results = folders
    table, missing = real_summary.build(results, {})
    text = real_summary.markdown(table, missing)
    assert ("- ReFusion, ReFusion (LoRA r=64, 3000 steps) on the CPU SFT base, "
            "ReFusion (chosen on val) (CPU, 2 cores)") in text


def val_rows(baseline: float, fast: float) -> list[dict]:
    return [{"key": "ar", "accuracy": 0.8, "num_samples": 15},
            {"key": "lowconf1", "accuracy": baseline, "num_samples": 15},
            {"key": "threshold", "accuracy": fast, "num_samples": 15}]


@pytest.mark.parametrize(("block", "bidir", "chosen"), [
    ((0.2, 0.2), (0.4, 0.1), "bidirectional"),  # the baseline's accuracy decides
    ((0.4, 0.1), (0.2, 0.9), "block-causal"),
    ((0.4, 0.1), (0.4, 0.3), "bidirectional"),  # a tie on the baseline: Fast-dLLM decides
    ((0.4, 0.3), (0.4, 0.3), "block-causal"),  # a full tie keeps the block-causal conversion
])
def test_mdm_attention_chosen_on_val(tmp_path, block, bidir, chosen):
    assert real_summary.mdm_attention_choice(tmp_path) is None  # not before both val tables exist
    (tmp_path / "cpu_mdm_val_block.json").write_text(json.dumps(val_rows(*block)))
    assert real_summary.mdm_attention_choice(tmp_path) is None
    (tmp_path / "cpu_mdm_val_bidir.json").write_text(json.dumps(val_rows(*bidir)))
    text = real_summary.mdm_attention_choice(tmp_path)
    assert f"Chosen: **{chosen}" in text and "15 val problems" in text
    assert ("not run yet" in text) == (chosen == "bidirectional")


def test_cover_rows_take_tps_over_base_ar_when_the_table_has_an_ar_row(folders):
    """A COVER table run with --base has TPS / base AR per row (the summary shows it); one without has
    none ("—"), never a ratio to another run's AR."""
    results = folders
    test = [{"decoder": d, "accuracy": 0.05, "tpf": 2.0, "num_samples": 20, "tps": 5.0} for d in
            ("WINO 0.6 / 0.9", "Saber n=2 / mu=8", "COVER tau=0.7", "COVER tau=0.7 without override")]
    (results / "gpu_cover_block32_h200.json").write_text(json.dumps({"test": test}))
    (results / "gpu_cover_bidir_h200.json").write_text(json.dumps(
        {"test": [{**r, "tps_vs_base_ar": 0.5 + k} for k, r in enumerate(test)]}))
    table, _ = real_summary.build(results, {})
    ratios = {r["short"]: r["tps_ratio"] for r in table}
    assert ratios == {"WINO, block32": None, "Saber, block32": None, "COVER, block32": None,
                      "WINO, bidir": 0.5, "Saber, bidir": 1.5, "COVER, bidir": 2.5}


def test_the_block8_cover_table_gives_its_goal_rows_and_the_chosen_tau(folders):
    """The block-8 COVER table (AR, WINO, Saber, COVER at the tau chosen on val and without override): WINO,
    Saber and the chosen COVER row are in the summary, marked block 8, with TPS / base AR and the block-8
    conversion's wall time; the ablation is not a row."""
    labels = ["AR greedy (base)", "WINO 0.6 / 0.9", "Saber n=2 / mu=8", "COVER tau=0.9",
              "COVER tau=0.9 without override"]
    (folders / "cpu_cover_block8.json").write_text(json.dumps({"test": [
        {"decoder": d, "accuracy": 0.5, "tpf": 2.0, "num_samples": 200, "tps": 5.0, "tps_vs_base_ar": 0.1 * k}
        for k, d in enumerate(labels)]}))
    conversion = {"smollm2_mdm_lora_2000_block8": {"wall_seconds": 3133.0}}
    (folders / "cpu_conversions.json").write_text(json.dumps(conversion))
    table, missing = real_summary.build(folders, real_summary.conversion_seconds(folders))
    rows = [r for r in table if r["source"] == "cpu_cover_block8"]
    assert [(r["decoder"], r["short"]) for r in rows] == [
        ("WINO 0.6 / 0.9", "WINO, block 8"), ("Saber n=2 / mu=8", "Saber, block 8"),
        ("COVER tau=0.9", "COVER, block 8")]
    assert [r["tps_ratio"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])
    assert {(r["checkpoint"], r["conversion_seconds"]) for r in rows} == {
        (real_summary.MDM_BLOCK8_CPU_CHECKPOINT, 3133.0)}
    assert "cpu_cover_block8" not in {r.source for r in missing}


def test_gpu_script_keeps_the_first_sft_base_and_replaces_a_conversion(tmp_path):
    """``scripts/real_model_gpu.sh``'s merge of a session's wall times into ``gpu_conversions_<gpu>.json``
    (its Python heredoc, run as the script runs it, with the runs whose tables are written): a rerun
    conversion replaces its entry, a new one is added, one not named (its tables not written) is left out,
    earlier sessions' entries stay, and the SFT base saved first stays (the summary's AR row); a run's training
    seconds (the walls file's third column, when the trainer logged them) are saved beside its wall time."""
    script = (Path(__file__).parents[1] / "scripts" / "real_model_gpu.sh").read_text()
    merge = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    out = tmp_path / "gpu_conversions_h200.json"
    out.write_text(json.dumps({"smollm2_sft_gpu": {"wall_seconds": 94, "training_seconds": 57.2},
                               "smollm2_idlm_gpu": {"wall_seconds": 239}, "smollm2_mdm_gpu": {"wall_seconds": 153},
                               "smollm2_mdm_block32_gpu": {"wall_seconds": 108}}))
    walls = tmp_path / "walls.tsv"
    walls.write_text("smollm2_sft_gpu\t90\nsmollm2_mdm_gpu\t140\t81.9\nsmollm2_jacobi_forcing_gpu\t250\n"
                     "smollm2_mdm_block32_gpu\t138\n")
    named = ["smollm2_sft_gpu", "smollm2_mdm_gpu", "smollm2_jacobi_forcing_gpu"]
    subprocess.run([sys.executable, "-", str(walls), str(out), *named], input=merge, text=True, check=True)
    assert json.loads(out.read_text()) == {
        "smollm2_sft_gpu": {"wall_seconds": 94, "training_seconds": 57.2}, "smollm2_idlm_gpu": {"wall_seconds": 239},
        "smollm2_mdm_gpu": {"wall_seconds": 140, "training_seconds": 81.9},
        "smollm2_mdm_block32_gpu": {"wall_seconds": 108}, "smollm2_jacobi_forcing_gpu": {"wall_seconds": 250}}
    out.unlink()  # a first session on this GPU model records its base
    subprocess.run([sys.executable, "-", str(walls), str(out), *named], input=merge, text=True, check=True)
    assert json.loads(out.read_text())["smollm2_sft_gpu"] == {"wall_seconds": 90}


def run_gpu_script(tmp_path: Path, failing_module: str = "", **env: str) -> subprocess.CompletedProcess:
    """``scripts/real_model_gpu.sh`` copied into an empty checkout (no ``runs/``: a fresh clone, a bare device
    machine) and run with a stub interpreter: ``-m`` commands (training, benchmarks) only echo (training also
    logs two stages of 1.5 s of training each, as the trainer words it), and ``failing_module`` fails; every
    other call is the real interpreter."""
    (tmp_path / "scripts").mkdir(parents=True)
    script = tmp_path / "scripts" / "real_model_gpu.sh"
    script.write_text((Path(__file__).parents[1] / "scripts" / "real_model_gpu.sh").read_text())
    stub = tmp_path / "python_stub"
    stub.write_text('#!/bin/sh\nif [ "$2" = pardec.cli.train ]; then for s in 0 1; do\n'
                    '  echo "[INFO] - stage runs/x/stages/0$s: 3 steps in 1.5 s of training"; done; fi\n'
                    f'if [ "$1" = -m ]; then echo "stub: $*"; [ "$2" != "{failing_module}" ]; exit; fi\n'
                    f'exec "{sys.executable}" "$@"\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "EVAL_SPLITS": "", "IDLM": "0", "CUDA_VISIBLE_DEVICES": "",
           **env}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)


def saved_conversions(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "benchmarks" / "results" / "real" / "gpu_conversions_cpu.json").read_text())


def test_gpu_script_runs_in_a_fresh_clone_without_runs(tmp_path):
    """In a checkout with no ``runs/`` the first training command's output reaches the training log and its
    wall time the conversions file. The 2026-11-28 H200 run stopped after the SFT base because ``tee`` could
    not open ``runs/…`` there."""
    done = run_gpu_script(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    train_log = (tmp_path / "runs" / "real_gpu_train.log").read_text()
    assert "stub: -m pardec.cli.train experiment=smollm2_sft_gpu" in train_log
    (name, saved), = saved_conversions(tmp_path).items()
    assert name == "smollm2_sft_gpu" and saved["training_seconds"] == 3.0  # the two stages' lines, summed


@pytest.mark.parametrize("table_fails", [False, True])
def test_gpu_script_saves_a_conversion_wall_time_once_its_tables_are_written(tmp_path, table_fails):
    """A conversion's wall time reaches the conversions file only after its tables: one stopped before
    (here its benchmark fails) leaves the file's entry to the conversion the saved tables show."""
    done = run_gpu_script(tmp_path, "pardec.benchmarks.jacobi_forcing" if table_fails else "", JACOBI="1")
    assert (done.returncode != 0) == table_fails, done.stdout + done.stderr
    assert "smollm2_jacobi_forcing_gpu\t" in (tmp_path / "runs" / "real_gpu_walls.tsv").read_text()
    expected = ["smollm2_sft_gpu"] + ([] if table_fails else ["smollm2_jacobi_forcing_gpu"])
    assert list(saved_conversions(tmp_path)) == expected


@pytest.mark.parametrize("attention", ["block", "block32"])
def test_gpu_script_runs_the_mdm_tables_in_each_decode_mode(tmp_path, attention):
    """MDM=1: the FlashDLM table, then the COVER table (with the base's AR row), each once per DECODE_MODES
    entry (graphs: --cuda-graphs, its own table name; the block-32 run's names carry _block32 first)."""
    done = run_gpu_script(tmp_path, MDM="1", MDM_ATTENTION=attention, DECODE_MODES="graphs eager")
    assert done.returncode == 0, done.stdout + done.stderr
    benchmarks = [line for line in done.stdout.splitlines() if line.startswith("stub: -m pardec.benchmarks.")]
    assert len(benchmarks) == 4
    suffix = "" if attention == "block" else "_block32"
    for (graphs, eager), table in zip((benchmarks[:2], benchmarks[2:]), ("mdm_flashdlm", "cover")):
        out = f"--out benchmarks/results/real/gpu_{table}{suffix}"
        assert f"pardec.benchmarks.{table} " in graphs and f"pardec.benchmarks.{table} " in eager
        assert "--cuda-graphs" in graphs and graphs.endswith(f"{out}_graphs_cpu")
        assert "--cuda-graphs" not in eager and eager.endswith(f"{out}_cpu")
    assert all("--base runs/smollm2_sft_gpu/hf" in line for line in benchmarks[2:])


def test_gpu_script_runs_the_refusion_table_in_each_decode_mode(tmp_path):
    """REFUSION=1: the ReFusion table once per DECODE_MODES entry (graphs: --cuda-graphs, its own table name)."""
    done = run_gpu_script(tmp_path, REFUSION="1", DECODE_MODES="graphs eager")
    assert done.returncode == 0, done.stdout + done.stderr
    refusion = [line for line in done.stdout.splitlines() if line.startswith("stub: -m pardec.benchmarks.refusion")]
    assert len(refusion) == 2
    out = "--out benchmarks/results/real/gpu_refusion"
    assert "--cuda-graphs" in refusion[0] and refusion[0].endswith(f"{out}_graphs_cpu")
    assert "--cuda-graphs" not in refusion[1] and refusion[1].endswith(f"{out}_cpu")


def test_gpu_script_passes_threads_to_every_benchmark(tmp_path):
    """THREADS reaches every benchmark's --threads (all tables on); a value that is not a positive integer
    stops the script at start, naming it."""
    done = run_gpu_script(tmp_path / "all", IDLM="1", MDM="1", JACOBI="1", REFUSION="1", DECODE_MODES="graphs",
                          THREADS="2")
    assert done.returncode == 0, done.stdout + done.stderr
    benchmarks = [line for line in done.stdout.splitlines() if line.startswith("stub: -m pardec.benchmarks.")]
    assert len(benchmarks) == 5
    assert all(" --threads 2 " in line for line in benchmarks)
    refused = run_gpu_script(tmp_path / "refused", THREADS="eight")
    assert refused.returncode == 2 and "THREADS must be a positive integer, got 'eight'" in refused.stderr
