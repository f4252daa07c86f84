"""pardec.benchmarks.real_model_speed on a tiny chat checkpoint: one latency row per (threads, width),
and the decoding table's Jacobi row token-identical to its AR greedy row (vanilla Jacobi is lossless)."""

from __future__ import annotations

import json

from pardec.benchmarks import real_model_speed
from pardec.common.kv_cache import CACHE_KEYWORD
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


def test_widths_are_timed_in_turn_from_the_same_cache(tmp_path):
    """forward_latencies interleaves the widths (a slow spell hits all alike) and every timed forward
    sees the same cache length: the prefill, then width after width, round after round."""
    from pardec.inference.checkpoint import load_checkpoint

    model, _ = load_checkpoint(save_chat_checkpoint(tmp_path / "ckpt"), device="cpu")
    seen = []
    original = model.forward

    def recording_forward(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], kwargs[CACHE_KEYWORD].get_seq_length()))
        return original(*args, **kwargs)

    model.forward = recording_forward
    seconds = real_model_speed.forward_latencies(model, [1, 3], cache_len=8, repeats=2)
    assert sorted(seconds) == [1, 3] and all(s > 0 for s in seconds.values())
    assert seen == [(8, 0)] + [(1, 8), (3, 8)] * 4  # 2 warm-up rounds + 2 timed
