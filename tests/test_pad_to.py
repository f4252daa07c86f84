"""data.pad_to=longest: each recipe's batches are as wide as their longest row, and its losses are the
ones of rows padded to data.pack_length (padding is attended by nothing and supervised nowhere)."""

from __future__ import annotations

import importlib

import pytest
from hydra.errors import ConfigCompositionException

from pardec.data_pipelines.packing import padded_length
from tests.train_utils import compose_train, logged_metrics, run_in_process

JACOBI = ["recipe=jacobi_forcing", "recipe.stages=[]", "data.max_train_samples=4", "recipe.block_size=4",
          "recipe.window=2", "recipe.max_new_tokens=8", "recipe.shard_size=2"]

RECIPES = {
    "idlm": ["recipe=idlm", "recipe.stages=[]"],
    "jacobi_forcing": JACOBI,
    "refusion": ["recipe=refusion", "recipe.slot_sizes=[2,4]", "recipe.export_slot_size=4"],
    "mdm": ["recipe=mdm"],
}
# The logged terms each recipe's loss returns besides the total.
TERMS = {
    "idlm": ("l_mask", "l_clean"),
    "jacobi_forcing": ("l_pc", "l_ar"),
    "refusion": ("l_arm", "l_mdm"),
    "mdm": ("loss",),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_longest_rows_train_the_losses_of_pack_length_rows(recipe, tmp_path, monkeypatch):
    module = importlib.import_module(f"pardec.methods.{recipe}")
    original = module.forward_logits
    widths: dict[str, list[int]] = {"pack_length": [], "longest": []}
    current = []

    def recording(model, batch):
        widths[current[-1]].append(int(batch["input_ids"].shape[1]))
        return original(model, batch)

    monkeypatch.setattr(module, "forward_logits", recording)
    first_steps = {}
    for pad_to in ("pack_length", "longest"):
        current.append(pad_to)
        out = tmp_path / pad_to
        result = run_in_process([*RECIPES[recipe], f"output_dir={out}", "trainer.max_steps=2",
                                 f"data.pad_to={pad_to}"])
        assert result.status == "finished"
        first_steps[pad_to] = logged_metrics(out)

    assert set(widths["pack_length"]) == {256}  # FAST's data.pack_length
    assert widths["longest"] and max(widths["longest"]) < 256
    for step_padded, step_longest in zip(first_steps["pack_length"], first_steps["longest"], strict=True):
        for key in TERMS[recipe]:
            assert key in step_padded, key
            assert step_longest[key] == pytest.approx(step_padded[key], rel=1e-4, abs=1e-6), key


def test_padded_length_and_a_bad_choice_is_named():
    rows, lengths = [[0, 1], [2], [3, 4]], [3, 4, 5, 2, 1]  # rows of 7, 5 and 3 slots
    assert padded_length(rows, lengths, 16, "pack_length") == 16
    assert padded_length(rows, lengths, 16, "longest") == 7
    with pytest.raises(ValueError, match="PadTo"):
        padded_length(rows, lengths, 16, "shortest")
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["recipe=idlm", "data.pad_to=shortest"])
    message = f"{err.value}\n{err.value.__cause__}"
    assert "full_key: data.pad_to" in message
    assert "Invalid value 'shortest', expected one of [pack_length, longest]" in message
