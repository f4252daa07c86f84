"""pardec.benchmarks.decoder_eval: decoder specs become batch-1 configs; bad specs get a named error."""
import pytest

from pardec.benchmarks.decoder_eval import decoder_configs
from pardec.common.errors import ConfigError


def test_specs_become_batch_one_configs_with_the_default_length():
    configs = decoder_configs(['{"name": "ar"}', '{"name": "refusion", "block_size": 8, "max_new_tokens": 32}'], 64)
    assert configs == [{"batch_size": 1, "max_new_tokens": 64, "name": "ar"},
                       {"batch_size": 1, "max_new_tokens": 32, "name": "refusion", "block_size": 8}]


@pytest.mark.parametrize("spec", ['{"name": "ar"', '["ar"]', '{"threshold": 0.5}'])
def test_bad_specs_are_named(spec):
    with pytest.raises(ConfigError, match="--decoder"):
        decoder_configs([spec], 64)


def test_mean_stats_averages_numeric_entries_per_sample():
    from pardec.benchmarks.decoder_eval import mean_stats
    records = [{"stats": {"remasks": 2, "steps": 10, "override": True, "mode": "x"}},
               {"stats": {"remasks": 0, "steps": 14, "capped": 3}}]
    assert mean_stats(records) == {"capped": 1.5, "remasks": 1.0, "steps": 12.0}
