"""pardec.benchmarks.common: which problems a split name selects."""
import pytest

from pardec.benchmarks.common import held_out_rows, split_rows, validation_rows


def test_split_rows_selects_the_named_split():
    val, test = split_rows("val", 5), split_rows("test", 5)
    assert list(val["prompt"]) == list(validation_rows(5)["prompt"])
    assert list(test["prompt"]) == list(held_out_rows(5)["prompt"])
    assert set(val["prompt"]).isdisjoint(test["prompt"])


def test_unknown_split_is_named():
    with pytest.raises(ValueError, match="'train'"):
        split_rows("train", 5)


def test_validate_eval_split_val_draws_the_validation_problems():
    """pardec-validate data.eval_split=val decodes the validation problems (disjoint from test),
    the same the benchmarks tune on; another word is refused naming the key."""
    from omegaconf import OmegaConf

    from pardec.common.errors import DataError
    from pardec.data_pipelines.config import DataConfig
    from pardec.data_pipelines.sources import load_raw_split

    cfg = OmegaConf.structured(DataConfig)
    cfg.max_eval_samples = 5
    assert list(load_raw_split(cfg, "eval")["prompt"]) == list(held_out_rows(5)["prompt"])
    cfg.eval_split = "val"
    assert list(load_raw_split(cfg, "eval")["prompt"]) == list(validation_rows(5)["prompt"])
    cfg.eval_split = "train"
    with pytest.raises(DataError, match="data.eval_split"):
        load_raw_split(cfg, "eval")
