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
