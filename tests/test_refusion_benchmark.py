"""pardec.benchmarks.refusion: the validation rule that picks (b, tau, first token), on hand-built tables,
the test phase's ablations of the chosen setting, and the test rows decoded in chunks."""
import json

from pardec.benchmarks.refusion import OWN_AR, ablations, check_goals, choose_setting, label, parse_args


def _setting(block: int, tau: float, first: str = "mask") -> dict:
    return {"block_size": block, "threshold": tau, "first_token": first}


def _row(name: str, accuracy: float, tpf: float, setting: dict | None = None) -> dict:
    config = {"name": "ar"} if setting is None else {"name": "refusion", **setting}
    return {"decoder": name, "accuracy": accuracy, "tpf": tpf, "config": config}


def _table(*settings: tuple) -> list[dict]:
    rows = [_row("AR greedy (base)", 0.90, 1.0), _row(OWN_AR, 0.99, 1.0)]
    return rows + [_row(label(_setting(b, tau, *first)), acc, tpf, _setting(b, tau, *first))
                   for b, tau, acc, tpf, *first in settings]


def test_picks_the_fastest_setting_within_the_tolerated_drop():
    table = _table((8, 0.9, 0.89, 2.1), (8, 0.5, 0.88, 2.4), (16, 0.5, 0.87, 3.0), (16, 0.9, 0.80, 3.5))
    setting, rule = choose_setting(table, max_drop=0.02)
    assert setting == _setting(8, 0.5)
    assert "highest TPF" in rule


def test_the_first_token_source_is_part_of_the_choice():
    table = _table((8, 0.5, 0.86, 2.9), (8, 0.5, 0.89, 2.8, "ar"), (8, 0.3, 0.87, 3.0, "ar"))
    assert choose_setting(table, max_drop=0.02)[0] == _setting(8, 0.5, "ar")


def test_own_ar_row_is_never_chosen_and_does_not_set_the_bar():
    # the checkpoint's own AR greedy is more accurate than the base; the bar stays the base's accuracy
    table = _table((8, 0.7, 0.885, 2.2), (16, 0.7, 0.70, 2.9))
    assert choose_setting(table, max_drop=0.02)[0] == _setting(8, 0.7)


def test_falls_back_to_the_most_accurate_then_the_fastest():
    table = _table((8, 0.9, 0.80, 2.1), (8, 0.5, 0.80, 2.4), (16, 0.5, 0.60, 3.0))
    setting, rule = choose_setting(table, max_drop=0.02)
    assert setting == _setting(8, 0.5)
    assert "most accurate" in rule


def test_ablations_flip_the_first_token_only_where_b_is_k():
    assert ablations(_setting(8, 0.5, "ar"), slot_size=8) == [{"kv_reuse": False}, {"fuse_plan": False},
                                                               {"first_token": "mask"}]
    assert ablations(_setting(16, 0.5), slot_size=8) == [{"kv_reuse": False}, {"fuse_plan": False}]
    chosen = _setting(8, 0.5, "ar")
    assert label(chosen, first_token="mask") == label(_setting(8, 0.5, "mask"))
    assert label(chosen, kv_reuse=False) == "ReFusion b=8 tau=0.5 first_token=ar, kv_reuse=false"


def test_ablations_keep_only_the_requested_ones():
    assert ablations(_setting(8, 0.5, "ar"), slot_size=8, which=("kv_reuse",)) == [{"kv_reuse": False}]
    assert ablations(_setting(8, 0.5), slot_size=8, which=("first_token",)) == [{"first_token": "ar"}]


def test_speculative_completion_is_in_the_label_and_ablated_only_where_on():
    chosen = {**_setting(8, 0.5, "ar"), "completion_drafts": None}
    assert label(chosen) == "ReFusion b=8 tau=0.5 first_token=ar completion_drafts=all"
    assert label({**chosen, "completion_drafts": 3}) == "ReFusion b=8 tau=0.5 first_token=ar completion_drafts=3"
    assert label(chosen, completion_drafts=0) == label(_setting(8, 0.5, "ar"))
    assert label(chosen, kv_reuse=False) == "ReFusion b=8 tau=0.5 first_token=ar completion_drafts=all, kv_reuse=false"
    assert ablations(chosen, slot_size=8, which=("kv_reuse", "completion_drafts")) == [
        {"kv_reuse": False}, {"completion_drafts": 0}]
    assert ablations({**chosen, "completion_drafts": 0}, slot_size=8, which=("completion_drafts",)) == []


def _test_table(chosen: dict, reuse_tps: float, recompute_tps: float, tpf: float, accuracy: float) -> list[dict]:
    rows = [_row("AR greedy (base)", 0.70, 1.0), _row(label(chosen), accuracy, tpf, chosen),
            _row(label(chosen, kv_reuse=False), accuracy, tpf, chosen)]
    for row, tps in zip(rows, (10.0, reuse_tps, recompute_tps), strict=True):
        row["tps"] = tps
    return rows


def test_goals_follow_the_flags_and_skip_recomputation_when_not_run():
    chosen = _setting(16, 0.7)
    # 2.6 TPF at 2.5 points below the base; reuse 1.8x recomputation
    table = _test_table(chosen, reuse_tps=18.0, recompute_tps=10.0, tpf=2.6, accuracy=0.675)
    embedded = parse_args(["--base", "b", "--refusion", "r"])
    goals, text = check_goals(table, chosen, slot_size=8, args=embedded)
    assert goals == {"tpf_2.5_within_2%": False, "kv_reuse_tps_1.5x_recompute": True,
                     "kv_reuse_accuracy_within_1_point_of_recompute": True}
    real = parse_args(["--base", "b", "--refusion", "r", "--goal-drop", "0.03", "--goal-reuse", "2",
                       "--ablations", "kv_reuse"])
    goals, text = check_goals(table, chosen, slot_size=8, args=real)
    assert goals == {"tpf_2.5_within_3%": True, "kv_reuse_tps_2x_recompute": False,
                     "kv_reuse_accuracy_within_1_point_of_recompute": True}
    assert "(1.80x)" in text
    # without the recomputation row only the TPF goal is judged
    none = parse_args(["--base", "b", "--refusion", "r", "--ablations"])
    goals, text = check_goals(table[:2], chosen, slot_size=8, args=none)
    assert goals == {"tpf_2.5_within_2%": False} and "recomputation" not in text


def refusion_checkpoints(tmp_path) -> list[str]:
    """``--base`` and ``--refusion`` flags naming tiny chat checkpoints saved under ``tmp_path``."""
    from pardec.common.constants import MASK_TOKEN
    from pardec.common.metadata import CheckpointMetadata
    from tests.conftest import chat_bpe_tokenizer, save_chat_checkpoint, tiny_model

    base = save_chat_checkpoint(tmp_path / "base")
    tok = chat_bpe_tokenizer()
    tok.add_tokens([MASK_TOKEN], special_tokens=True)
    model = tiny_model(len(tok), "llama", 1, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       pad_token_id=None)
    CheckpointMetadata(recipe="refusion", mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
                       slot_size=4).write_to(model)
    model.save_pretrained(tmp_path / "refusion")
    tok.save_pretrained(tmp_path / "refusion")
    return ["--base", str(base), "--refusion", str(tmp_path / "refusion")]


# the flags reproduce --real uses, sized for tiny checkpoints
REAL_MODEL_FLAGS = ["--num-val", "2", "--num-samples", "2", "--block-sizes", "4", "8", "--first-tokens", "mask",
                    "--thresholds", "0.9", "0.5", "--test-chosen-only", "--ablations", "kv_reuse", "--no-own-ar",
                    "--goal-drop", "0.03", "--goal-reuse", "2", "--max-new-tokens", "8", "--threads", "1"]


def run_real_model_flags(tmp_path, *flags: str) -> dict:
    """The benchmark with the flags ``reproduce --real`` uses (and ``flags``) on tiny chat checkpoints."""
    from pardec.benchmarks.refusion import main

    out = tmp_path / "result"
    main([*refusion_checkpoints(tmp_path), *REAL_MODEL_FLAGS, "--out", str(out), *flags])
    return json.loads(out.with_suffix(".json").read_text())


def test_speculative_completion_end_to_end(tmp_path):
    """--completion-drafts all: every ReFusion row completes speculatively and the test phase adds the
    chosen setting without it; greedy, the two decode the same tokens."""
    payload = run_real_model_flags(tmp_path, "--completion-drafts", "all", "--ablations", "kv_reuse",
                                   "completion_drafts")
    chosen = payload["chosen_label"]
    assert chosen.endswith(" completion_drafts=all")
    assert all(r["config"]["completion_drafts"] is None for r in payload["validation"][1:])
    rows = {r["decoder"]: r for r in payload["test"]}
    paper = chosen.removesuffix(" completion_drafts=all")
    assert list(rows) == ["AR greedy (base)", chosen, chosen + ", kv_reuse=false", paper]
    assert rows[paper]["config"]["completion_drafts"] == 0
    assert rows[paper]["accuracy"] == rows[chosen]["accuracy"] and rows[paper]["tpf"] <= rows[chosen]["tpf"]


def test_real_model_run_flags_end_to_end(tmp_path):
    """The flags reproduce --real uses, on tiny chat checkpoints: the chosen tau alone on test, only the
    recomputation ablation, no own-AR rows ("= own AR" absent), the goals as asked."""
    payload = run_real_model_flags(tmp_path)
    assert len(payload["validation"]) == 1 + 4 and all(r["identical_to_own_ar"] is None for r in payload["validation"])
    chosen = payload["chosen_label"]
    assert [r["decoder"] for r in payload["test"]] == ["AR greedy (base)", chosen, chosen + ", kv_reuse=false"]
    assert set(payload["goals"]) == {"tpf_2.5_within_3%", "kv_reuse_tps_2x_recompute",
                                     "kv_reuse_accuracy_within_1_point_of_recompute"}
    assert all(r["num_samples"] == 2 for r in payload["test"])
    # recomputation decodes the same tokens as KV reuse (the ablation changes the cost only)
    assert payload["test"][1]["accuracy"] == payload["test"][2]["accuracy"]


def test_cuda_graphs_rows_measure_what_eager_rows_measure(tmp_path):
    """--cuda-graphs: every row (AR greedy, ReFusion with KV reuse and recomputation) over static steps; on
    CPU they run eagerly, so every column but the timings equals the eager run's."""
    eager = run_real_model_flags(tmp_path / "eager")
    graphs = run_real_model_flags(tmp_path / "graphs", "--cuda-graphs")
    assert graphs["chosen_label"] == eager["chosen_label"]

    def untimed(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in ("tps", "tps_ratio", "config")}

    for phase in ("validation", "test"):
        assert len(graphs[phase]) == len(eager[phase]) > 1
        for got, expected in zip(graphs[phase], eager[phase]):
            assert got["config"] == {**expected["config"], "cuda_graphs": True}
            assert untimed(got) == untimed(expected)


def test_refusion_in_chunks_equals_one_run_and_keeps_its_val_table(tmp_path, monkeypatch):
    """The test rows pooled from chunks of one problem equal one run's, time aside (the choice on val is made
    by accuracy and TPF, so both runs test the same setting). A run stopped after its first chunk leaves that
    chunk's table; a rerun decodes only the rest; read back again it decodes nothing, the val sweep included."""
    import pardec.benchmarks.chunks as chunks
    import pardec.benchmarks.refusion as bench
    from pardec.benchmarks.refusion import VALIDATION_FILE, main
    from tests.conftest import interrupt_evaluate, stopped_after_first_chunk

    args = [*refusion_checkpoints(tmp_path), *REAL_MODEL_FLAGS, "--num-samples", "3", "--ablations", "kv_reuse",
            "first_token"]
    main([*args, "--out", str(tmp_path / "one")])
    one = json.loads((tmp_path / "one.json").read_text())
    rows, val_rows = len(one["test"]), len(one["validation"])
    # base AR, the chosen setting, its recomputation and, where b = k = 4, its other first-token source
    assert rows == 3 + (one["chosen_block_size"] == 4)

    # Stopped after the val sweep (a warm-up and a decode per row) and the first chunk's rows (likewise).
    chunked = stopped_after_first_chunk(monkeypatch, bench, args, tmp_path, rows, 3, decoding=chunks,
                                        before=2 * val_rows)
    calls = interrupt_evaluate(monkeypatch, chunks, after=3 * rows)
    main(chunked)
    assert calls == [1] * (3 * rows)  # the rows' warm-ups on the second chunk, then two chunks of every row
    pooled = json.loads((tmp_path / "c.json").read_text())
    assert "problems done" not in (tmp_path / "c.md").read_text()
    assert pooled["chosen_label"] == one["chosen_label"] and pooled["goals"].keys() == one["goals"].keys()

    def untimed(table: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k not in ("tps", "tps_ratio")} for row in table]

    assert untimed(pooled["test"]) == untimed(one["test"])
    assert untimed(pooled["validation"]) == untimed(one["validation"])
    assert [len(json.loads((tmp_path / "chunks" / f"{i:04d}-{i + 1:04d}.json").read_text())["rows"])
            for i in range(3)] == [rows] * 3

    calls = interrupt_evaluate(monkeypatch, chunks, after=0)  # nothing may be decoded now
    main(chunked)
    assert calls == []
    assert json.loads((tmp_path / "c.json").read_text()) == pooled  # read back: the same table, times included
    assert f"read from {tmp_path / 'chunks' / VALIDATION_FILE}" in (tmp_path / "c.md").read_text()
