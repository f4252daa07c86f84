"""pardec.benchmarks.idlm_isd on a chat model with only an R-ISD export (the real-model run): the rows
are AR greedy and R-ISD, R-ISD's output equals the base's AR greedy token for token (computed by the
AR row of the same run), and the R-ISD row carries its TPF · t(1)/t(2N-1) bound."""

from __future__ import annotations

import json

import pytest

from pardec.benchmarks import chunks, idlm_isd
from tests.conftest import interrupt_evaluate, save_chat_checkpoint, stopped_after_first_chunk
from tests.train_utils import run_in_process


def test_risd_only_run_on_a_chat_model(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm_lora", "model=hf", f"model.path={base}",
        "data.pack_length=512", "trainer.max_steps=2", "recipe.lora_rank=4", "recipe.lora_alpha=8",
    ])
    out = tmp_path / "table"
    idlm_isd.main(["--base", str(base), "--risd", str(result.export_dir), "--num-samples", "2",
                   "--max-new-tokens", "8", "--threads", "1", "--split", "val", "--bound-cache", "8",
                   "--bound-repeats", "1", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["decoder"] for r in rows] == ["AR greedy (base)", "R-ISD N=3 greedy (gated LoRA)"]
    assert rows[1]["identical_to_base"] == 1.0 and rows[1]["tpf"] >= 1.0 and rows[1]["num_samples"] == 2
    # the bound TPF * t(1)/t(5) of the stride-3 row, and the share of it its TPS / AR reaches
    assert rows[0]["bound"] is None and rows[1]["bound"] == pytest.approx(rows[1]["tpf"] / rows[1]["t_verify_over_t_1"])
    assert rows[1]["share_of_bound"] == rows[1]["tps_ratio"] / rows[1]["bound"]
    assert out.with_suffix(".md").read_text().startswith("Command: python -m pardec.benchmarks.idlm_isd")


def test_nothing_to_compare_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--idlm, --risd"):
        idlm_isd.main(["--base", str(tmp_path)])


def isd_row(n: int, tps: float, own: float) -> dict:
    return {"decoder": f"ISD N={n} greedy", "stride": n, "greedy": True, "tps": tps, "identical_to_own_ar": own}


def test_n_is_the_fastest_lossless_greedy_row_on_val():
    val = [{"decoder": "AR greedy (base)", "stride": None, "greedy": True, "tps": 50.0, "identical_to_own_ar": 1.0},
           {"decoder": "AR greedy (I-DLM ckpt)", "stride": None, "greedy": True, "tps": 40.0,
            "identical_to_own_ar": 1.0},
           isd_row(2, 20.0, 1.0), isd_row(3, 25.0, 1.0), isd_row(4, 30.0, 0.95),
           {"decoder": "ISD N=6 sample T=1.0", "stride": 6, "greedy": False, "tps": 99.0, "identical_to_own_ar": 1.0}]
    assert idlm_isd.choose_stride(val)[0] == 3  # N=4 is faster but not lossless; AR and sampled rows never chosen
    assert idlm_isd.choose_stride([isd_row(2, 20.0, 0.9), isd_row(4, 30.0, 0.5)]) == (
        4, "none of the greedy rows is identical to own AR greedy on val: the highest TPS")


def test_n_chosen_on_val_then_the_test_rows_use_it_and_the_test_strides(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm", "model=hf", f"model.path={base}", "data.pack_length=512",
        "recipe.stages=[{name: s2, max_steps: 1, overrides: {stride: 2}}]",
    ])
    out = tmp_path / "table"
    idlm_isd.main(["--base", str(base), "--idlm", str(result.export_dir), "--num-samples", "2", "--num-val", "2",
                   "--strides", "2", "3", "--test-strides", "4", "--no-sample", "--max-new-tokens", "8",
                   "--threads", "1", "--bound-cache", "8", "--bound-repeats", "1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["decoder"] for r in data["validation"]] == [
        "AR greedy (base)", "AR greedy (I-DLM ckpt)", "ISD N=2 greedy", "ISD N=3 greedy"]
    assert (data["chosen_stride"], data["choice_rule"]) == idlm_isd.choose_stride(data["validation"])
    n = data["chosen_stride"]
    # the N chosen on val (2 or 3), then --test-strides' 4, which val never decoded
    assert data["test_strides"] == [n, 4]
    assert [r["decoder"] for r in data["test"]] == [
        "AR greedy (base)", "AR greedy (I-DLM ckpt)", f"ISD N={n} greedy", "ISD N=4 greedy"]
    for row in data["test"][2:]:
        assert row["identical_to_own_ar"] == 1.0 and row["num_samples"] == 2
        assert row["bound"] == pytest.approx(row["tpf"] / row["t_verify_over_t_1"])  # its width's latency measured
    md = out.with_suffix(".md").read_text()
    assert f"N chosen here: {n}" in md and f"Test split, 2 problems, ISD at N = {n}, 4:" in md


def test_num_val_needs_an_idlm_checkpoint_and_the_test_split_and_test_strides_need_num_val(tmp_path):
    with pytest.raises(SystemExit, match="give --idlm"):
        idlm_isd.main(["--base", str(tmp_path), "--risd", str(tmp_path), "--num-val", "2"])
    with pytest.raises(SystemExit, match="drop --split val"):
        idlm_isd.main(["--base", str(tmp_path), "--idlm", str(tmp_path), "--num-val", "2", "--split", "val"])
    with pytest.raises(SystemExit, match="--test-strides adds test rows beside the N chosen on val: give --num-val"):
        idlm_isd.main(["--base", str(tmp_path), "--idlm", str(tmp_path), "--test-strides", "4"])


def risd_export(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm_lora", "model=hf", f"model.path={base}",
        "data.pack_length=512", "trainer.max_steps=2", "recipe.lora_rank=4", "recipe.lora_alpha=8",
    ])
    return base, result.export_dir


def test_risd_in_chunks_equals_one_run_and_resumes(tmp_path, monkeypatch):
    """AR and R-ISD pooled from chunks of one problem equal one run's, time aside (alpha included: it is
    pooled from each record's introspection); a run stopped after its first chunk leaves that chunk's table
    saying so, and a rerun decodes only the rest."""
    base, risd = risd_export(tmp_path)
    args = ["--base", str(base), "--risd", str(risd), "--num-samples", "3", "--max-new-tokens", "8",
            "--threads", "1", "--split", "val", "--no-bound"]
    idlm_isd.main([*args, "--out", str(tmp_path / "one")])

    chunked = stopped_after_first_chunk(monkeypatch, idlm_isd, args, tmp_path, rows=2, problems=3, decoding=chunks)
    calls = interrupt_evaluate(monkeypatch, chunks, after=6)
    idlm_isd.main(chunked)
    assert calls == [1, 1, 1, 1, 1, 1]  # the rows' warm-ups on the second chunk, then two chunks of two rows
    one, pooled = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "c"))
    assert "problems done" not in (tmp_path / "c.md").read_text()
    timeless = ("tps", "tps_ratio")
    assert [{k: v for k, v in r.items() if k not in timeless} for r in pooled] == \
           [{k: v for k, v in r.items() if k not in timeless} for r in one]
    assert pooled[1]["identical_to_base"] == 1.0 and pooled[1]["alpha"] > 0
    assert sorted(p.name for p in (tmp_path / "chunks").iterdir()) == [
        "0000-0001.json", "0001-0002.json", "0002-0003.json"]


def test_the_val_choice_and_the_bound_are_kept_beside_the_chunks_and_read_on_restart(tmp_path, monkeypatch):
    """A restart (or a table read back from its chunks) decodes the rows val chose the first time, and shows
    the bound's latencies measured the first time: neither is measured again."""
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm", "model=hf", f"model.path={base}", "data.pack_length=512",
        "recipe.stages=[{name: s2, max_steps: 1, overrides: {stride: 2}}]",
    ])
    args = ["--base", str(base), "--idlm", str(result.export_dir), "--num-samples", "2", "--num-val", "2",
            "--strides", "2", "3", "--no-sample", "--max-new-tokens", "8", "--threads", "1", "--bound-cache", "8",
            "--bound-repeats", "1", "--chunk-dir", str(tmp_path / "chunks"), "--out", str(tmp_path / "t")]
    idlm_isd.main(args)
    first = json.loads((tmp_path / "t.json").read_text())
    for name in (idlm_isd.VALIDATION_FILE, chunks.BOUND_FILE):
        assert (tmp_path / "chunks" / name).is_file()

    def measured_again(*a, **k):
        raise AssertionError("the validation sweep or the bound's latencies were measured again")

    monkeypatch.setattr(idlm_isd, "measure", measured_again)
    monkeypatch.setattr(chunks, "forward_latencies", measured_again)
    idlm_isd.main(args)
    again = json.loads((tmp_path / "t.json").read_text())
    assert (again["chosen_stride"], again["validation"]) == (first["chosen_stride"], first["validation"])
    assert again["test"] == first["test"]  # read back, nothing decoded: the same table, times and bound included
    md = (tmp_path / "t.md").read_text()
    assert f"read from {tmp_path / 'chunks' / idlm_isd.VALIDATION_FILE}" in md
    assert f"t(q) read from {tmp_path / 'chunks' / chunks.BOUND_FILE}" in md
    # Another sweep's settings: the kept choice is refused by name, not reused.
    with pytest.raises(ValueError, match="validation.json was made by another setting"):
        idlm_isd.main([*args[:args.index("--num-val") + 1], "1", *args[args.index("--num-val") + 2:]])


def test_sampled_rows_in_chunks_draw_what_one_run_draws(tmp_path):
    """Each problem's sampling seed follows its number in the split, so sampled ISD decoded in chunks of one
    problem commits the tokens one run commits (the table equal, time aside)."""
    base = save_chat_checkpoint(tmp_path / "base")
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm", "model=hf", f"model.path={base}", "data.pack_length=512",
        "recipe.stages=[{name: s2, max_steps: 1, overrides: {stride: 2}}]",
    ])
    args = ["--base", str(base), "--idlm", str(result.export_dir), "--num-samples", "3", "--strides", "2",
            "--max-new-tokens", "8", "--temperature", "3.0", "--threads", "1", "--split", "val", "--no-bound"]
    idlm_isd.main([*args, "--out", str(tmp_path / "one")])
    idlm_isd.main([*args, "--chunk-dir", str(tmp_path / "chunks"), "--chunk-size", "1", "--out", str(tmp_path / "c")])
    one, pooled = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "c"))
    assert [r["decoder"] for r in one][-1] == "ISD N=2 sample T=3.0"
    timeless = ("tps", "tps_ratio")
    assert [{k: v for k, v in r.items() if k not in timeless} for r in pooled] == \
           [{k: v for k, v in r.items() if k not in timeless} for r in one]
    saved = [json.loads(p.read_text())["rows"]["ISD N=2 sample T=3.0"] for p in sorted((tmp_path / "chunks").iterdir())]
    assert [[r["index"] for r in records] for records in saved] == [[0], [1], [2]]  # numbered as in one run
