"""``pardec.benchmarks.cover``'s choice of tau_draft on validation (``--select``), on hand-made rows, and its
``--rows``: the test rows it names, in the table's order, the TPS / baseline cell a dash without the baseline."""

from __future__ import annotations

import json

import pytest

from pardec.benchmarks.cover import AR_LABEL, ROW_KEYS, choose_tau, main, parse_args, table_rows

TUNING = [  # validation rows of three taus: faster is less accurate
    {"tau_draft": 0.7, "accuracy": 0.70, "steps_per_sample": 12.0},
    {"tau_draft": 0.8, "accuracy": 0.80, "steps_per_sample": 13.0},
    {"tau_draft": 0.9, "accuracy": 0.90, "steps_per_sample": 14.0},
]


def test_accuracy_rule_takes_the_most_accurate_then_the_fewest_steps():
    assert choose_tau(TUNING, "accuracy")["tau_draft"] == 0.9
    tied = TUNING + [{"tau_draft": 0.95, "accuracy": 0.90, "steps_per_sample": 13.5}]
    assert choose_tau(tied, "accuracy")["tau_draft"] == 0.95


def test_baselines_rule_takes_the_fewest_steps_at_the_baselines_accuracy_or_better():
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.75)["tau_draft"] == 0.8
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.70)["tau_draft"] == 0.7  # equal accuracy counts
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.95)["tau_draft"] == 0.9  # none: the most accurate


def test_rows_names_the_test_rows_in_the_tables_order_and_refuses_unknown_keys(capsys):
    chosen = parse_args(["--mdm", "m", "--base", "b", "--rows", "cover_no_override,wino,ar,cover"])
    assert chosen.rows == ("ar", "wino", "cover", "cover_no_override")
    assert [label for label, _ in table_rows(chosen, 0.9)] == [
        AR_LABEL, "WINO 0.6 / 0.9", "COVER tau=0.9", "COVER tau=0.9 without override"]
    everything = parse_args(["--mdm", "m", "--base", "b"])
    assert everything.rows is None and len(table_rows(everything, 0.9)) == len(ROW_KEYS)
    assert AR_LABEL not in dict(table_rows(parse_args(["--mdm", "m"]), 0.9))  # all, without --base: no AR row
    with pytest.raises(SystemExit):
        parse_args(["--mdm", "m", "--rows", "cover,llada"])
    assert "unknown row key(s) llada" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--mdm", "m", "--rows", "ar,cover"])
    assert "--rows ar needs --base" in capsys.readouterr().err


def test_without_the_baseline_row_the_tps_ratio_is_a_dash(tmp_path):
    from tests.test_mdm_benchmarks_real_flags import chat_mdm_export

    mdm, out = chat_mdm_export(tmp_path / "mdm"), tmp_path / "r"
    main(["--mdm", str(mdm), "--num-samples", "2", "--num-validation", "1", "--max-new-tokens", "8",
          "--block-size", "4", "--taus", "0.9", "--rows", "cover,cover_no_override", "--template", "chat",
          "--out", str(out)])
    table = json.loads(out.with_suffix(".json").read_text())["test"]
    assert [r["decoder"] for r in table] == ["COVER tau=0.9", "COVER tau=0.9 without override"]
    assert all(r["tps_ratio"] is None and r["tps"] > 0 for r in table)
    rows = [line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| COVER")]
    assert len(rows) == 2 and all(line.split(" | ")[5] == "—" for line in rows)  # the TPS / baseline cell
