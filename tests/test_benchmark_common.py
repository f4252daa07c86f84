"""pardec.benchmarks.common: which problems a split name selects, and what a written table records."""
import json

import pytest

from pardec.benchmarks.common import (
    MACHINES,
    add_split_arg,
    fresh_rows,
    held_out_rows,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.common.run_records import machine_description


def test_split_rows_selects_the_named_split():
    val, test = split_rows("val", 5), split_rows("test", 5)
    assert list(val["prompt"]) == list(validation_rows(5)["prompt"])
    assert list(test["prompt"]) == list(held_out_rows(5)["prompt"])
    assert set(val["prompt"]).isdisjoint(test["prompt"])


def test_split_rows_selects_a_fresh_split_disjoint_from_val_and_test():
    fresh = split_rows("fresh1", 5)
    assert list(fresh["prompt"]) == list(fresh_rows("fresh1", 5)["prompt"])
    assert set(fresh["prompt"]).isdisjoint(validation_rows(200)["prompt"])
    assert set(fresh["prompt"]).isdisjoint(held_out_rows(200)["prompt"])
    assert list(fresh["prompt"]) != list(split_rows("fresh2", 5)["prompt"])
    assert [split_label(s) for s in ("test", "val", "fresh3")] == ["test split", "validation split",
                                                                  "fresh split fresh3"]


@pytest.mark.parametrize("name", ["train", "fresh", "fresh0"])
def test_unknown_split_is_named(name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        split_rows(name, 5)


def test_split_flag_takes_fresh_splits_and_val_only_where_allowed(capsys):
    """``--split``: test, val and fresh<k>; a benchmark that tunes on val first reports on test or a
    fresh split, and refuses ``--split val`` naming what it takes."""
    import argparse

    both, reported = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_split_arg(both)
    add_split_arg(reported, val=False)
    assert both.parse_args([]).split == "test"
    assert [both.parse_args(["--split", s]).split for s in ("val", "fresh2")] == ["val", "fresh2"]
    assert reported.parse_args(["--split", "fresh1"]).split == "fresh1"
    with pytest.raises(SystemExit):
        reported.parse_args(["--split", "val"])
    assert "'val': expected test or fresh<k>" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        both.parse_args(["--split", "fresh0"])


def test_validate_eval_split_val_draws_the_validation_problems():
    """pardec-validate data.eval_split=val decodes the validation problems (disjoint from test),
    the same the benchmarks tune on, and data.eval_split=fresh1 the benchmarks' fresh1 problems; another
    word is refused naming the key."""
    from omegaconf import OmegaConf

    from pardec.common.errors import DataError
    from pardec.data_pipelines.config import DataConfig
    from pardec.data_pipelines.sources import load_raw_split

    cfg = OmegaConf.structured(DataConfig)
    cfg.max_eval_samples = 5
    assert list(load_raw_split(cfg, "eval")["prompt"]) == list(held_out_rows(5)["prompt"])
    cfg.eval_split = "val"
    assert list(load_raw_split(cfg, "eval")["prompt"]) == list(validation_rows(5)["prompt"])
    cfg.eval_split = "fresh1"
    assert list(load_raw_split(cfg, "eval")["prompt"]) == list(fresh_rows("fresh1", 5)["prompt"])
    for word in ("train", "fresh0"):
        cfg.eval_split = word
        with pytest.raises(DataError, match="data.eval_split"):
            load_raw_split(cfg, "eval")


def test_written_tables_name_their_machine_beside_the_command(tmp_path):
    """Every table's Markdown names the machine under its command, and ``machines.json`` beside the
    tables keeps each table's machine by its stem (the real summary reads it: TPS compare only within
    a machine)."""
    import torch

    write_results(tmp_path / "first", "python -m x --a 1", "| t |", [{"tps": 1.0}])
    write_results(tmp_path / "second", "python -m y", "body", {"rows": []})
    lines = (tmp_path / "first.md").read_text().splitlines()
    assert lines[:3] == ["Command: python -m x --a 1",
                         f"Machine: {machine_description()}, torch {torch.__version__}", ""]
    assert json.loads((tmp_path / "first.json").read_text()) == [{"tps": 1.0}]
    machines = json.loads((tmp_path / MACHINES).read_text())
    assert set(machines) == {"first", "second"}
    assert machines["first"]["cpu"] == machine_description() and machines["first"]["gpu"] is None
    assert machines["first"]["torch"] == torch.__version__ and machines["first"]["written"]


def test_gpu_decoding_tables_name_their_machine_and_the_device_they_ran_on(tmp_path):
    """The GPU decoding benchmark's tables (which can also run with ``--device cpu``) carry the same
    ``Machine:`` line and ``machines.json`` entry as every other table, with the decoding device above
    the table."""
    import torch

    from pardec.benchmarks.gpu_decoding import write

    write(tmp_path / "gpu_decoding_graphs", "python -m pardec.benchmarks.gpu_decoding --tables graphs", "CPU",
          "| step |", [{"step": "eager", "ms_per_token": 2.0}])
    lines = (tmp_path / "gpu_decoding_graphs.md").read_text().splitlines()
    assert lines[:5] == ["Command: python -m pardec.benchmarks.gpu_decoding --tables graphs",
                         f"Machine: {machine_description()}, torch {torch.__version__}", "",
                         "Ran on: CPU, bf16, batch 1.", ""]
    assert json.loads((tmp_path / "gpu_decoding_graphs.json").read_text())["device"] == "CPU"
    assert set(json.loads((tmp_path / MACHINES).read_text())) == {"gpu_decoding_graphs"}
