"""pardec.benchmarks.jacobi_forcing with the real-model flags: one round, no wide rows, no training
table, chat prompts, the bound column; every parallel row lossless against its own AR greedy."""

from __future__ import annotations

import json

from pardec.benchmarks.jacobi_forcing import main
from pardec.common.metadata import CheckpointMetadata
from tests.conftest import chat_bpe_tokenizer, save_chat_checkpoint, tiny_model


def test_one_round_real_model_flags_end_to_end(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    tok = chat_bpe_tokenizer()
    model = tiny_model(len(tok), "llama", 1, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       pad_token_id=None)
    CheckpointMetadata(recipe="jacobi_forcing", jacobi_block_size=4).write_to(model)
    model.save_pretrained(tmp_path / "round1")
    tok.save_pretrained(tmp_path / "round1")
    out = tmp_path / "result"
    main(["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "2", "--max-new-tokens", "8",
          "--wide-block-size", "0", "--no-training-table", "--bound-repeats", "2", "--bound-cache", "8",
          "--template", "chat", "--threads", "1", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    rows = {r["decoder"]: r for r in payload["decoding"]}
    multiblock = "Multi-block + recycling n=4 K=2 r=0.85 pool=4 verify=4 (round 1)"
    assert list(rows) == ["AR greedy (base)", "Jacobi n=4 (base, untrained)", "AR greedy (round 1)",
                          "Jacobi n=4 (round 1)", multiblock]
    assert payload["training_efficiency"] is None
    assert all(r["identical_to_own_ar"] == 1.0 and r["num_samples"] == 2 for r in rows.values())
    jacobi = rows["Jacobi n=4 (round 1)"]
    assert jacobi["bound"] > 0 and jacobi["share_of_bound"] == jacobi["tps_ratio"] / jacobi["bound"]
    assert rows[multiblock]["bound"] is None and rows["AR greedy (base)"]["bound"] is None
    md = out.with_suffix(".md").read_text()
    assert "share of bound" in md and "Training step" not in md and "2 test problems" in md
