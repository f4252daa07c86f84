"""ReFusion recipe through the trainer: export metadata, logged terms, step-seeded buffers, bad config."""

from __future__ import annotations

import pytest
import torch

from pardec.common.errors import ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.methods.refusion import ReFusionConfig, ReFusionMethod
from tests.conftest import tiny_tokenizer
from tests.train_utils import exported_weights, logged_metrics, run_in_process


def test_recipe_trains_and_records_decoding_metadata(tmp_path):
    result = run_in_process([f"output_dir={tmp_path}", "recipe=refusion", "recipe.slot_sizes=[2,4]",
                             "recipe.export_slot_size=4", "trainer.max_steps=4"])
    assert result.status == "finished"
    meta = CheckpointMetadata.read(result.export_dir)
    assert meta.recipe == "refusion" and meta.slot_size == 4 and meta.mask_token_id is not None
    records = logged_metrics(tmp_path)
    assert len(records) == 4
    for r in records:
        assert r["l_arm"] > 0 and r["l_mdm"] > 0 and r["loss"] == pytest.approx(r["l_arm"] + r["l_mdm"], rel=1e-4)


def test_resume_rebuilds_the_same_buffers(tmp_path):
    common = ["recipe=refusion", "recipe.slot_sizes=[2,4]", "trainer.max_steps=4"]
    straight = run_in_process([f"output_dir={tmp_path / 'straight'}", *common])
    run_in_process([f"output_dir={tmp_path / 'resumed'}", *common, "trainer.stop_after_steps=2"])
    resumed = run_in_process([f"output_dir={tmp_path / 'resumed'}", *common])
    a, b = exported_weights(straight.export_dir), exported_weights(resumed.export_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_lora_run_records_the_metadata_and_starts_at_the_full_runs_loss(tmp_path):
    """model.lora on recipe=refusion: with B = 0 the first step sees the full run's model and the same
    step-seeded buffers, so each loss term is the full run's; the merged export is a ReFusion checkpoint."""
    common = ["recipe=refusion", "recipe.slot_sizes=[2,4]", "recipe.export_slot_size=4", "trainer.max_steps=1"]
    full = run_in_process([f"output_dir={tmp_path / 'full'}", *common])
    lora = run_in_process([f"output_dir={tmp_path / 'lora'}", *common, "model.lora.rank=4"])
    (a,), (b,) = (logged_metrics(r.export_dir.parent) for r in (full, lora))
    for term in ("l_arm", "l_mdm", "loss"):
        assert b[term] == pytest.approx(a[term], rel=1e-6, abs=0), term
    meta = CheckpointMetadata.read(lora.export_dir)
    assert meta.recipe == "refusion" and meta.slot_size == 4 and meta.mask_token_id is not None
    assert exported_weights(lora.export_dir).keys() == exported_weights(full.export_dir).keys()


def _method(**overrides):
    tokenizer = tiny_tokenizer(("<|mask|>",))
    method = ReFusionMethod(ReFusionConfig(**overrides), tokenizer)
    method.mask_token_id, method.pack_length = tokenizer.convert_tokens_to_ids("<|mask|>"), 64
    return method


def test_collate_is_a_function_of_the_step():
    examples = [{"input_ids": list(range(3, 3 + n)), "prompt_len": 2, "index": i} for i, n in enumerate((12, 9, 15))]

    def batch(method, step):
        method.begin_step(step)
        return method.collate(examples)

    a, b, c = batch(_method(), 7), batch(_method(), 7), batch(_method(), 8)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])
    assert not (torch.equal(a["input_ids"], c["input_ids"]) and torch.equal(a["position_ids"], c["position_ids"]))


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"slot_sizes": [4, 0]}, r"recipe.slot_sizes"),
        ({"masking": "half"}, r"recipe.masking"),
        ({"mdm_norm": "sum"}, r"recipe.mdm_norm"),
        ({"mdm_lambda": -1.0}, r"recipe.mdm_lambda"),
        ({"in_order_prob": 1.5}, r"recipe.in_order_prob"),
        ({"suffix_mask_prob": -0.1}, r"recipe.suffix_mask_prob"),
    ],
)
def test_bad_recipe_values_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _method(**overrides)


def test_slot_size_larger_than_max_length_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe.slot_sizes.*slot size 512 larger than data.max_length=256"):
        run_in_process([f"output_dir={tmp_path}", "recipe=refusion", "recipe.slot_sizes=[4,512]",
                        "data.max_length=256", "trainer.max_steps=1"])
