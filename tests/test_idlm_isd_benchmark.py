"""pardec.benchmarks.idlm_isd on a chat model with only an R-ISD export (the real-model run): the rows
are AR greedy and R-ISD, R-ISD's output equals the base's AR greedy token for token (computed by the
AR row of the same run), and the R-ISD row carries its TPF · t(1)/t(2N-1) bound."""

from __future__ import annotations

import json

import pytest

from pardec.benchmarks import idlm_isd
from tests.conftest import save_chat_checkpoint
from tests.train_utils import run_in_process


def test_risd_only_run_on_a_chat_model(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm_lora", "model=hf", f"model.path={base}",
        "data.pack_length=512", "trainer.max_steps=2", "recipe.lora_rank=4", "recipe.lora_alpha=8",
    ])
    out = tmp_path / "table"
    idlm_isd.main(["--base", str(base), "--risd", str(result.export_dir), "--num-samples", "2",
                   "--max-new-tokens", "8", "--threads", "1", "--split", "val", "--bound-cache", "8",
                   "--bound-repeats", "1", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["decoder"] for r in rows] == ["AR greedy (base)", "R-ISD N=3 greedy (gated LoRA)"]
    assert rows[1]["identical_to_base"] == 1.0 and rows[1]["tpf"] >= 1.0 and rows[1]["num_samples"] == 2
    # the bound TPF * t(1)/t(5) of the stride-3 row, and the share of it its TPS / AR reaches
    assert rows[0]["bound"] is None and rows[1]["bound"] == pytest.approx(rows[1]["tpf"] / rows[1]["t_verify_over_t_1"])
    assert rows[1]["share_of_bound"] == rows[1]["tps_ratio"] / rows[1]["bound"]
    assert out.with_suffix(".md").read_text().startswith("Command: python -m pardec.benchmarks.idlm_isd")


def test_nothing_to_compare_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--idlm, --risd"):
        idlm_isd.main(["--base", str(tmp_path)])


def isd_row(n: int, tps: float, own: float) -> dict:
    return {"decoder": f"ISD N={n} greedy", "stride": n, "greedy": True, "tps": tps, "identical_to_own_ar": own}


def test_n_is_the_fastest_lossless_greedy_row_on_val():
    val = [{"decoder": "AR greedy (base)", "stride": None, "greedy": True, "tps": 50.0, "identical_to_own_ar": 1.0},
           {"decoder": "AR greedy (I-DLM ckpt)", "stride": None, "greedy": True, "tps": 40.0,
            "identical_to_own_ar": 1.0},
           isd_row(2, 20.0, 1.0), isd_row(3, 25.0, 1.0), isd_row(4, 30.0, 0.95),
           {"decoder": "ISD N=6 sample T=1.0", "stride": 6, "greedy": False, "tps": 99.0, "identical_to_own_ar": 1.0}]
    assert idlm_isd.choose_stride(val)[0] == 3  # N=4 is faster but not lossless; AR and sampled rows never chosen
    assert idlm_isd.choose_stride([isd_row(2, 20.0, 0.9), isd_row(4, 30.0, 0.5)]) == (
        4, "none of the greedy rows is identical to own AR greedy on val: the highest TPS")


def test_n_chosen_on_val_then_the_test_rows_use_it_and_the_test_strides(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm", "model=hf", f"model.path={base}", "data.pack_length=512",
        "recipe.stages=[{name: s2, max_steps: 1, overrides: {stride: 2}}]",
    ])
    out = tmp_path / "table"
    idlm_isd.main(["--base", str(base), "--idlm", str(result.export_dir), "--num-samples", "2", "--num-val", "2",
                   "--strides", "2", "3", "--test-strides", "4", "--no-sample", "--max-new-tokens", "8",
                   "--threads", "1", "--bound-cache", "8", "--bound-repeats", "1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["decoder"] for r in data["validation"]] == [
        "AR greedy (base)", "AR greedy (I-DLM ckpt)", "ISD N=2 greedy", "ISD N=3 greedy"]
    assert (data["chosen_stride"], data["choice_rule"]) == idlm_isd.choose_stride(data["validation"])
    n = data["chosen_stride"]
    # the N chosen on val (2 or 3), then --test-strides' 4, which val never decoded
    assert data["test_strides"] == [n, 4]
    assert [r["decoder"] for r in data["test"]] == [
        "AR greedy (base)", "AR greedy (I-DLM ckpt)", f"ISD N={n} greedy", "ISD N=4 greedy"]
    for row in data["test"][2:]:
        assert row["identical_to_own_ar"] == 1.0 and row["num_samples"] == 2
        assert row["bound"] == pytest.approx(row["tpf"] / row["t_verify_over_t_1"])  # its width's latency measured
    md = out.with_suffix(".md").read_text()
    assert f"N chosen here: {n}" in md and f"Test split (2 problems; ISD at N = {n}, 4)" in md


def test_num_val_needs_an_idlm_checkpoint_and_the_test_split_and_test_strides_need_num_val(tmp_path):
    with pytest.raises(SystemExit, match="give --idlm"):
        idlm_isd.main(["--base", str(tmp_path), "--risd", str(tmp_path), "--num-val", "2"])
    with pytest.raises(SystemExit, match="drop --split val"):
        idlm_isd.main(["--base", str(tmp_path), "--idlm", str(tmp_path), "--num-val", "2", "--split", "val"])
    with pytest.raises(SystemExit, match="--test-strides adds test rows beside the N chosen on val: give --num-val"):
        idlm_isd.main(["--base", str(tmp_path), "--idlm", str(tmp_path), "--test-strides", "4"])
