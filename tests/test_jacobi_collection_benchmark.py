"""pardec.benchmarks.jacobi_collection on a tiny chat checkpoint: one row per batch size, every row
equal to batch 1's, forwards per prompt as collecting each prompt alone counts them."""

from __future__ import annotations

import json

import torch

from pardec.benchmarks import jacobi_collection
from pardec.data_pipelines.jacobi_trajectories import CollectSettings, collect_one
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import format_prompt_ids, stop_token_ids
from pardec.inference.checkpoint import load_checkpoint
from tests.conftest import save_chat_checkpoint


def test_batches_equal_batch_one_and_count_forwards(tmp_path):
    ckpt = save_chat_checkpoint(tmp_path / "ckpt")
    jacobi_collection.main(["--model", str(ckpt), "--num-prompts", "5", "--batch-sizes", "1", "3",
                            "--block-size", "3", "--max-new-tokens", "6", "--threads", "1",
                            "--out", str(tmp_path / "table")])
    table = json.loads((tmp_path / "table.json").read_text())
    assert [r["batch_size"] for r in table] == [1, 3]
    assert [r["equal_to_first"] for r in table] == [1.0, 1.0] and table[0]["speedup"] == 1.0

    model, tok = load_checkpoint(ckpt, device="cpu", dtype="float32")
    data_cfg = jacobi_collection.OmegaConf.structured(jacobi_collection.DataConfig)
    data_cfg.max_train_samples = 5
    settings = CollectSettings(block_size=3, max_new_tokens=6, eos_token_ids=tuple(sorted(stop_token_ids(tok))),
                               pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        forwards = [collect_one(model, i, format_prompt_ids(tok, row["prompt"], "auto"), settings)["forwards"]
                    for i, row in enumerate(load_raw_split(data_cfg, "train"))]
    assert table[1]["forwards_per_prompt"] == table[0]["forwards_per_prompt"] == sum(forwards) / 5
    assert (tmp_path / "table.md").read_text().startswith("Command: python -m pardec.benchmarks.jacobi_collection")
