"""pardec.benchmarks.jacobi_forcing with the real-model flags: one round, no wide rows, no training
table, chat prompts, the bound column; every parallel row lossless against its own AR greedy; and the
block size chosen on val (the fastest lossless Jacobi row) used by the test rows."""

from __future__ import annotations

import json

import pytest

from pardec.benchmarks.jacobi_forcing import choose_block_size, main
from pardec.benchmarks.real_summary import jacobi_short
from pardec.common.metadata import CheckpointMetadata
from tests.conftest import chat_bpe_tokenizer, save_chat_checkpoint, tiny_model


def save_base_and_round1(tmp_path):
    """A tiny chat base and a random "round 1" trained at n=4 (untrained weights: Jacobi decoding is
    lossless whatever the weights); returns the base's directory, the round's is ``tmp_path/round1``."""
    base = save_chat_checkpoint(tmp_path / "base")
    tok = chat_bpe_tokenizer()
    model = tiny_model(len(tok), "llama", 1, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       pad_token_id=None)
    CheckpointMetadata(recipe="jacobi_forcing", jacobi_block_size=4).write_to(model)
    model.save_pretrained(tmp_path / "round1")
    tok.save_pretrained(tmp_path / "round1")
    return base


def test_one_round_real_model_flags_end_to_end(tmp_path):
    base = save_base_and_round1(tmp_path)
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


def jacobi_row(n: int, tps: float, own: float, model: str = "round1") -> dict:
    return {"decoder": f"Jacobi n={n}", "model": model, "decoder_config": {"name": "jacobi", "block_size": n},
            "tps": tps, "identical_to_own_ar": own}


def test_n_is_the_fastest_lossless_jacobi_row_of_a_trained_round():
    ar = {"decoder": "AR greedy (round 1)", "model": "round1", "decoder_config": {"name": "ar"}, "tps": 99.0,
          "identical_to_own_ar": 1.0}
    val = [ar, jacobi_row(16, 50.0, 1.0, model="base"), jacobi_row(4, 10.0, 1.0), jacobi_row(8, 12.0, 1.0),
           jacobi_row(16, 15.0, 0.9)]
    assert choose_block_size(val) == (8, "the highest TPS among the Jacobi rows identical to own AR greedy")
    assert choose_block_size([jacobi_row(4, 10.0, 0.9), jacobi_row(8, 12.0, 0.5)])[0] == 8


def test_n_chosen_on_val_then_the_test_rows_use_it(tmp_path):
    """With --cuda-graphs as well: every row runs over static steps, still lossless."""
    base = save_base_and_round1(tmp_path)
    out = tmp_path / "result"
    main(["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "2", "--max-new-tokens", "8",
          "--num-val", "2", "--val-block-sizes", "2", "4", "--wide-block-size", "0", "--no-training-table",
          "--bound-repeats", "1", "--bound-cache", "8", "--threads", "1", "--cuda-graphs", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    for r in payload["decoding"]:  # every row over static steps (run eagerly off a GPU)
        assert r["decoder_config"]["cuda_graphs"] and r["identical_to_own_ar"] == 1.0
    assert [r["decoder"] for r in payload["validation"]] == [
        "AR greedy (base)", "AR greedy (round 1)", "Jacobi n=2 (round 1, trained at n=4)", "Jacobi n=4 (round 1)"]
    n = payload["chosen_block_size"]
    assert (n, payload["choice_rule"]) == choose_block_size(payload["validation"])
    assert payload["chosen_multiblock_block_size"] == n and payload["multiblock_choice_rule"] is None
    labels = [r["decoder"] for r in payload["decoding"]]
    assert labels[1] == f"Jacobi n={n} (base, untrained)"
    assert payload["chosen_labels"]["jacobi"] in labels and payload["chosen_labels"]["multiblock"] in labels
    assert all(r["decoder_config"]["block_size"] == n for r in payload["decoding"]
               if r["decoder_config"]["name"] != "ar")
    assert f"n chosen here: {n}" in out.with_suffix(".md").read_text()


def test_multiblock_n_chosen_on_its_own(tmp_path):
    """--choose-multiblock-n: val also runs multi-block at every n; its test row decodes at the n chosen among
    those rows by the same rule, which the JSON and the summary's label record."""
    base = save_base_and_round1(tmp_path)
    out = tmp_path / "result"
    main(["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "2", "--max-new-tokens", "8",
          "--num-val", "2", "--val-block-sizes", "2", "4", "--wide-block-size", "0", "--no-training-table",
          "--no-bound", "--threads", "1", "--choose-multiblock-n", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    val = payload["validation"]
    assert [r["decoder_config"]["name"] for r in val] == ["ar", "ar", "jacobi", "jacobi", "multiblock", "multiblock"]
    assert [r["decoder_config"]["block_size"] for r in val[4:]] == [2, 4]
    n, n_multiblock = payload["chosen_block_size"], payload["chosen_multiblock_block_size"]
    assert (n_multiblock, payload["multiblock_choice_rule"]) == choose_block_size(val, "multiblock")
    assert "multi-block rows" in payload["multiblock_choice_rule"]
    decoded = {r["decoder_config"]["name"]: r for r in payload["decoding"] if r["model"] == "round1"}
    assert decoded["jacobi"]["decoder_config"]["block_size"] == n
    assert decoded["multiblock"]["decoder_config"]["block_size"] == n_multiblock
    assert payload["chosen_labels"]["multiblock"] == decoded["multiblock"]["decoder"]
    assert jacobi_short("multiblock", "multi-block")(payload) == f"multi-block n={n_multiblock}"
    assert f"multi-block's n chosen here: {n_multiblock}" in out.with_suffix(".md").read_text()


def test_num_val_reports_on_test(tmp_path):
    with pytest.raises(SystemExit, match="drop --split val"):
        main(["--base", str(tmp_path), "--round1", str(tmp_path), "--num-val", "2", "--split", "val"])


def test_skip_rows_leaves_the_lossless_rows(tmp_path):
    """--skip-rows base-jacobi multiblock: AR greedy of each model and the round's Jacobi row only, n still
    chosen on val; the markdown and the JSON say what was left out and chosen_labels names no skipped row."""
    base = save_base_and_round1(tmp_path)
    out = tmp_path / "result"
    main(["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "2", "--max-new-tokens", "8",
          "--num-val", "2", "--val-block-sizes", "2", "4", "--wide-block-size", "8", "--no-training-table",
          "--no-bound", "--threads", "1", "--skip-rows", "base-jacobi", "multiblock", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    n = payload["chosen_block_size"]
    assert [r["decoder"] for r in payload["decoding"]] == [
        "AR greedy (base)", "AR greedy (round 1)", f"Jacobi n={n} (round 1" + (")" if n == 4 else ", trained at n=4)"),
        "Jacobi n=8 (round 1, trained at n=4)"]
    assert all(r["identical_to_own_ar"] == 1.0 for r in payload["decoding"])
    assert payload["skipped_rows"] == ["base-jacobi", "multiblock"]
    assert list(payload["chosen_labels"]) == ["jacobi"]
    assert "chosen_multiblock_block_size" not in payload and "multiblock_choice_rule" not in payload
    assert "Rows skipped (--skip-rows): base-jacobi, multiblock." in out.with_suffix(".md").read_text()


def test_skip_rows_one_kind_keeps_the_other(tmp_path):
    base = save_base_and_round1(tmp_path)
    out = tmp_path / "result"
    main(["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "1", "--max-new-tokens", "4",
          "--wide-block-size", "0", "--no-training-table", "--no-bound", "--threads", "1",
          "--skip-rows", "base-jacobi", "--out", str(out)])
    labels = [r["decoder"] for r in json.loads(out.with_suffix(".json").read_text())["decoding"]]
    assert labels == ["AR greedy (base)", "AR greedy (round 1)", "Jacobi n=4 (round 1)",
                      "Multi-block + recycling n=4 K=2 r=0.85 pool=4 verify=4 (round 1)"]


def test_skipping_multiblock_refuses_choosing_its_n(tmp_path):
    with pytest.raises(SystemExit, match="--skip-rows multiblock"):
        main(["--base", str(tmp_path), "--round1", str(tmp_path), "--num-val", "2", "--choose-multiblock-n",
              "--skip-rows", "multiblock"])


def test_jacobi_in_chunks_equals_one_run_and_keeps_its_val_choice(tmp_path, monkeypatch):
    """The test rows pooled from chunks of one problem equal one run's, time aside: each problem's draft seed
    follows its number in the split, so the random drafts (draft_init=context) and with them TPF are the same.
    A run stopped after its first chunk leaves that chunk's table; a rerun decodes only the rest; read back
    again it measures neither the val sweep nor the bound anew."""
    import pardec.benchmarks.chunks as chunks
    import pardec.benchmarks.jacobi_forcing as bench
    from pardec.benchmarks.common import identical
    from tests.conftest import interrupt_evaluate, stopped_after_first_chunk

    base = save_base_and_round1(tmp_path)
    args = ["--base", str(base), "--round1", str(tmp_path / "round1"), "--num-samples", "3", "--max-new-tokens", "8",
            "--num-val", "2", "--val-block-sizes", "4", "--wide-block-size", "0", "--no-training-table",
            "--bound-repeats", "1", "--bound-cache", "8", "--template", "chat", "--threads", "1"]
    main([*args, "--out", str(tmp_path / "one")])  # one n on val: the choice by TPS cannot differ between runs
    one = json.loads((tmp_path / "one.json").read_text())
    rows = len(one["decoding"])

    # Stopped after the val sweep (a warm-up and a decode per row) and the first chunk's rows (likewise).
    chunked = stopped_after_first_chunk(monkeypatch, bench, args, tmp_path, rows, 3, decoding=chunks,
                                        before=2 * len(one["validation"]))
    calls = interrupt_evaluate(monkeypatch, chunks, after=3 * rows)
    main(chunked)
    assert calls == [1] * (3 * rows)  # the rows' warm-ups on the second chunk, then two chunks of every row
    pooled = json.loads((tmp_path / "c.json").read_text())
    timeless = ("tps", "tps_ratio", "bound", "share_of_bound")  # the bound's latencies are measured in each run
    for got, want in zip(pooled["decoding"], one["decoding"], strict=True):
        assert {k: v for k, v in got.items() if k not in timeless} == \
               {k: v for k, v in want.items() if k not in timeless}
    assert "problems done" not in (tmp_path / "c.md").read_text()
    saved = [json.loads((tmp_path / "chunks" / f"{i:04d}-{i + 1:04d}.json").read_text())["rows"] for i in range(3)]
    jacobi = pooled["chosen_labels"]["jacobi"]
    assert all(identical(c[jacobi], c["AR greedy (round 1)"]) == 1.0 for c in saved)  # lossless on every chunk

    def measured_again(*a, **k):
        raise AssertionError("the validation sweep or the bound's latencies were measured again")

    monkeypatch.setattr(bench, "measure", measured_again)
    monkeypatch.setattr(chunks, "forward_latencies", measured_again)
    main(chunked)
    again = json.loads((tmp_path / "c.json").read_text())
    assert again == pooled  # read back, nothing decoded or measured: the same table, times and bound included
    md = (tmp_path / "c.md").read_text()
    assert f"read from {tmp_path / 'chunks' / bench.VALIDATION_FILE}" in md
    assert f"t(q) read from {tmp_path / 'chunks' / chunks.BOUND_FILE}" in md


def test_chunks_need_no_training_table(tmp_path):
    with pytest.raises(SystemExit, match="add --no-training-table"):
        main(["--base", str(tmp_path), "--round1", str(tmp_path), "--chunk-dir", str(tmp_path / "chunks")])
