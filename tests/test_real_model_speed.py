"""pardec.benchmarks.real_model_speed on a tiny chat checkpoint: one latency row per (threads, width),
and the decoding table's Jacobi row token-identical to its AR greedy row (vanilla Jacobi is lossless)."""

from __future__ import annotations

import json

from pardec.benchmarks import real_model_speed
from tests.conftest import save_chat_checkpoint


def test_tables_are_written_with_a_lossless_jacobi_row(tmp_path):
    ckpt = save_chat_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "speed"
    real_model_speed.main(["--model", str(ckpt), "--widths", "1", "4", "--threads", "1", "--cache", "16",
                           "--repeats", "2", "--num-samples", "2", "--max-new-tokens", "8", "--block-size", "4",
                           "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    assert [(r["threads"], r["query_tokens"]) for r in payload["latency"]] == [(1, 1), (1, 4)]
    assert payload["latency"][0]["ratio_to_1"] == 1.0 and payload["latency"][1]["ms"] > 0
    ar, jacobi = payload["decoding"]
    assert ar["tps_ratio"] == 1.0 and jacobi["identical_to_ar"] == 1.0 and jacobi["tpf"] >= 1.0
    assert jacobi["bound"] is not None
    text = out.with_suffix(".md").read_text()
    assert text.startswith("Command: python -m pardec.benchmarks.real_model_speed") and "Jacobi n=4" in text
