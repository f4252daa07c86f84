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
