"""The chunk bootstrap's intervals (pardec.benchmarks.chunk_intervals): point values are the pooled
table's, the interval of a two-chunk table is the extreme of its three possible resamples (worked
out by hand), references are found by decoder config, chunks that disagree are refused by name, and
the committed intervals are what the committed chunks give today, with the benchmarks' own ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pardec.benchmarks import chunk_intervals
from pardec.benchmarks.chunk_intervals import reference_of, table_intervals
from pardec.benchmarks.chunks import CHUNK_FILES, write_chunk
from pardec.cli.reproduce import REAL

ROOT = Path(__file__).resolve().parents[1]
AR = {"name": "ar", "max_new_tokens": 64}
BASELINE = {"name": "mdm_lowconf", "block_size": 2}
FREECACHE = {"name": "mdm_lowconf", "block_size": 2, "freecache": True}
MACHINE = {"cpu": "test CPU", "gpu": None, "torch": "x"}


def records(committed: list[int], seconds: list[float], correct: list[bool]) -> list[dict]:
    return [{"index": i, "committed": c, "wall_time_s": s, "correct": ok}
            for i, (c, s, ok) in enumerate(zip(committed, seconds, correct))]


def write_table(chunk_dir: Path, rows: list[tuple[str, dict]], chunks: list[dict[str, list[dict]]], size: int = 2):
    fingerprint = {"benchmark": "test", "rows": [[key, decoder] for key, decoder in rows]}
    for i, chunk in enumerate(chunks):
        write_chunk(chunk_dir / f"{i * size:04d}-{(i + 1) * size:04d}.json", fingerprint, chunk, MACHINE)


def two_chunk_table(tmp_path: Path) -> Path:
    # chunk 0: ar 20 tok / 2 s, baseline 10 tok / 5 s, freecache 10 tok / 2 s
    # chunk 1: ar 30 tok / 2 s, baseline 12 tok / 4 s, freecache 12 tok / 1 s
    chunks = [
        {"ar": records([10, 10], [1, 1], [True, True]), "base": records([5, 5], [2, 3], [True, False]),
         "fc": records([5, 5], [1, 1], [True, False])},
        {"ar": records([15, 15], [1, 1], [True, False]), "base": records([6, 6], [2, 2], [False, False]),
         "fc": records([6, 6], [0.5, 0.5], [False, False])},
    ]
    write_table(tmp_path, [("ar", AR), ("base", BASELINE), ("fc", FREECACHE)], chunks)
    return tmp_path


def test_point_values_are_the_pooled_tables_and_a_two_chunk_interval_spans_its_three_resamples(tmp_path):
    table = table_intervals(two_chunk_table(tmp_path), resamples=10000, seed=0)
    assert (table["chunks"], table["problems"], table["machine"]) == (2, 4, MACHINE)
    rows = {r["row"]: r for r in table["rows"]}
    fc = rows["fc"]
    # Pooled: fc 22 tok / 3 s, baseline 22 tok / 9 s, ar 50 tok / 4 s.
    assert fc["tps"] == pytest.approx(22 / 3)
    assert fc["tps_vs_baseline"] == pytest.approx((22 / 3) / (22 / 9))
    assert fc["tps_vs_base_ar"] == pytest.approx((22 / 3) / (50 / 4))
    # The three resamples of two chunks: both chunk 0, one of each (the pooled value), both chunk 1. Each
    # extreme has probability 1/4, so the 2.5th and 97.5th percentiles are the extremes themselves.
    only0, only1 = (10 / 2) / (10 / 5), (12 / 1) / (12 / 4)
    assert fc["tps_vs_baseline_interval"] == pytest.approx([min(only0, only1), max(only0, only1)])
    # Accuracy gap, paired: chunk 0 fc 1/2 against ar 2/2, chunk 1 fc 0/2 against ar 1/2.
    assert fc["accuracy"] == pytest.approx(1 / 4) and fc["accuracy_gap"] == pytest.approx(1 / 4 - 3 / 4)
    assert fc["accuracy_gap_interval"] == pytest.approx([-1 / 2, -1 / 2])
    assert rows["ar"]["tps_vs_base_ar_interval"] == pytest.approx([1.0, 1.0])
    # One seed, one interval; the draws are shared by every row.
    assert table_intervals(tmp_path, resamples=10000, seed=0) == table


def test_references_are_found_by_decoder_config():
    assert reference_of(AR) == "base_ar"
    assert reference_of(BASELINE) == "baseline"
    assert reference_of(FREECACHE) is None
    assert reference_of({**BASELINE, "steps_per_block": 1}) is None  # two tokens per step in blocks of 2
    assert reference_of({"name": "mdm_threshold", "threshold": 0.9}) is None
    assert reference_of({"name": "cover", "draft_threshold": 0.9}) is None


def test_a_table_without_a_baseline_has_no_baseline_ratio(tmp_path):
    chunks = [{"ar": records([4], [1], [True]), "fc": records([4], [0.5], [True])} for _ in range(3)]
    write_table(tmp_path, [("ar", AR), ("fc", FREECACHE)], chunks, size=1)
    table = table_intervals(tmp_path, resamples=200, seed=1)
    fc = table["rows"][1]
    assert fc["tps_vs_baseline"] is None and fc["tps_vs_baseline_interval"] is None
    assert fc["tps_vs_base_ar"] == pytest.approx(2.0) and fc["tps_vs_base_ar_interval"] == pytest.approx([2.0, 2.0])
    assert "| fc | 100.0% | +0.0 [+0.0, +0.0] | 8.00 | 2.00 [2.00, 2.00] | — |" in chunk_intervals.markdown([table])


def test_disagreeing_broken_or_missing_chunks_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no chunk files"):
        table_intervals(tmp_path, resamples=200, seed=0)
    two_chunk_table(tmp_path)
    other = tmp_path / "0002-0004.json"
    saved = json.loads(other.read_text())
    saved["fingerprint"]["benchmark"] = "another"
    other.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="0002-0004.json was made by another setting"):
        table_intervals(tmp_path, resamples=200, seed=0)
    (tmp_path / "0000-0002.json").write_text("{")
    with pytest.raises(ValueError, match="0000-0002.json is not a chunk"):
        table_intervals(tmp_path, resamples=200, seed=0)


def test_too_few_resamples_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        chunk_intervals.parse_args([str(tmp_path), "--resamples", "10"])


# Each chunked benchmark's JSON keys for TPS / base AR and TPS / baseline (None: the benchmark has no baseline).
SAVED_RATIOS = {"idlm_isd": ("tps_ratio", None), "jacobi_forcing": ("tps_ratio", None), "refusion": ("tps_ratio", None),
                "mdm_flashdlm": ("tps_vs_base_ar", "tps_vs_mdm_baseline"), "cover": ("tps_vs_base_ar", "tps_ratio")}


def saved_test_rows(saved) -> list[dict]:
    """A chunked benchmark's test rows from its JSON: the table itself, or under ``test`` (a val phase beside
    it), or under ``decoding`` (``jacobi_forcing``'s)."""
    return saved if isinstance(saved, list) else saved.get("test") or saved["decoding"]


def test_the_committed_intervals_are_what_the_committed_chunks_give_with_the_benchmarks_ratios():
    committed = json.loads((ROOT / REAL / "chunk_intervals.json").read_text())
    for table in committed["tables"]:
        again = table_intervals(ROOT / table["chunk_dir"], committed["resamples"], committed["seed"])
        assert json.loads(json.dumps({**again, "chunk_dir": table["chunk_dir"]})) == table, table["chunk_dir"]
        # The point ratios, computed another way: by the benchmark that wrote the table.
        saved = json.loads((ROOT / REAL / f"{Path(table['chunk_dir']).name}.json").read_text())
        saved_rows = saved_test_rows(saved)
        chunk = json.loads(next(iter(sorted((ROOT / table["chunk_dir"]).glob(CHUNK_FILES)))).read_text())
        ar_key, baseline_key = SAVED_RATIOS[chunk["fingerprint"]["benchmark"]]
        assert len(saved_rows) == len(table["rows"])
        for mine, theirs in zip(table["rows"], saved_rows):
            assert mine["accuracy"] == pytest.approx(theirs["accuracy"])
            assert mine["tps_vs_base_ar"] == pytest.approx(theirs[ar_key])
            baseline = theirs.get(baseline_key) if baseline_key else None
            assert mine["tps_vs_baseline"] == (pytest.approx(baseline) if baseline is not None else None)
    assert {Path(t["chunk_dir"]).name for t in committed["tables"]} == {
        p.name for p in (ROOT / REAL / "chunks").iterdir() if p.is_dir()}
