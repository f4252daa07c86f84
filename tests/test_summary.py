"""pardec/benchmarks/summary.py: the table is the benchmarks' own numbers, lossless claims are checked
against measured identity, and bad or missing inputs get a named error."""

from __future__ import annotations

import json

import pytest

from pardec.benchmarks import summary

IDENTITY_KEYS = {  # the keys each benchmark writes, spelled out here (not read from summary.SOURCES)
    "idlm_isd": ("identical_to_base", "identical_to_own_ar", "tps_ratio"),
    "jacobi_forcing": ("identical_to_base", "identical_to_own_ar", "tps_ratio"),
    "refusion": ("identical_to_base", "identical_to_own_ar", "tps_ratio"),
    "mdm_flashdlm": ("identical_to_base_ar", None, "tps_vs_base_ar"),
    "cover": (None, None, None),
}
LABELS = {
    "idlm_isd": ["AR greedy (base)", "ISD N=2 greedy", "ISD N=3 greedy", "ISD N=4 greedy", "ISD N=4 sample T=1.0",
                 "R-ISD N=3 greedy (gated LoRA)"],
    "jacobi_forcing": ["Jacobi n=16 (round 2)", "Multi-block + recycling n=16 K=2 r=0.85 pool=4 verify=4 (round 2)",
                       "Jacobi n=32 (round 2, trained at n=16)",
                       "Multi-block + recycling n=32 K=2 r=0.85 pool=4 verify=4 (round 2)"],
    "refusion": ["AR greedy (base)", "AR greedy (ReFusion checkpoint)", "ReFusion b=8 tau=0.9", "ReFusion b=8 tau=0.7",
                 "ReFusion b=8 tau=0.7, kv_reuse=false"],
    "mdm_flashdlm": ["MDM low-confidence, 1 token/step (baseline)", "MDM Fast-dLLM threshold tau=0.9 (prefix cache)",
                     "FreeCache (refresh), low-confidence 1/step", "FreeCache + guided (assisted, strict)",
                     "Guided (shifted, strict; = base AR greedy)"],
    "cover": ["LLaDA low-confidence, 1 token/step (baseline)", "WINO 0.6 / 0.9", "Saber n=2 / mu=8", "COVER tau=0.8",
              "COVER tau=0.8, seeds fed masked (paper)", "COVER tau=0.8 without override"],
}


def fake_row(source: str, label: str, i: int) -> dict:
    base_key, own_key, ratio_key = IDENTITY_KEYS[source]
    row = {"decoder": label, "accuracy": 0.01 * (i + 1), "tpf": 1.0 + 0.1 * i, "tps": 100.0 + i}
    if base_key:
        row[base_key] = 1.0  # every decoder identical to its references unless a test says otherwise
    if own_key:
        row[own_key] = 1.0
    if ratio_key:
        row[ratio_key] = 0.5 + 0.01 * i
    return row


def write_results(tmp_path, edit=None):
    rows = {s: [fake_row(s, label, i) for i, label in enumerate(labels)] for s, labels in LABELS.items()}
    if edit:
        edit(rows)
    files = {
        "idlm_isd": rows["idlm_isd"],
        "jacobi_forcing": {"decoding": rows["jacobi_forcing"], "training_efficiency": {}},
        "refusion": {"chosen_block_size": 8, "chosen_threshold": 0.7, "chosen_label": "ReFusion b=8 tau=0.7",
                     "validation": [], "test": rows["refusion"]},
        "mdm_flashdlm": rows["mdm_flashdlm"],
        "cover": {"validation": [], "test": rows["cover"]},
    }
    results = tmp_path / "results"
    results.mkdir()
    for name, data in files.items():
        (results / f"{name}.json").write_text(json.dumps(data))
    return results, rows


def by_decoder(table):
    return {(r["source"], r["decoder"]): r for r in table}


def test_table_values_are_the_benchmarks_own(tmp_path):
    results, rows = write_results(tmp_path)
    table = by_decoder(summary.build(summary.load_sources(results), {}))
    for source, entries in rows.items():
        base_key, _, ratio_key = IDENTITY_KEYS[source]
        for entry in entries:
            got = table.get((source, entry["decoder"]))
            if got is None:
                continue  # not every benchmark row is a summary row
            assert got["accuracy"] == entry["accuracy"] and got["tpf"] == entry["tpf"]
            assert got["identical_to_base"] == (entry[base_key] if base_key else None)
            assert got["tps_ratio"] == (entry[ratio_key] if ratio_key else None)
    assert len(table) == len(summary.ROWS)


def test_chosen_settings_pick_the_benchmarks_choice(tmp_path):
    results, _ = write_results(tmp_path)
    table = by_decoder(summary.build(summary.load_sources(results), {}))
    assert ("refusion", "ReFusion b=8 tau=0.7") in table and ("refusion", "ReFusion b=8 tau=0.9") not in table
    assert ("cover", "COVER tau=0.8") in table and ("cover", "COVER tau=0.8 without override") not in table
    assert ("cover", "COVER tau=0.8, seeds fed masked (paper)") not in table


def test_a_lossless_claim_below_full_identity_is_not_marked(tmp_path):
    def break_risd(rows):
        rows["idlm_isd"][5]["identical_to_base"] = 0.99  # R-ISD claims = base AR greedy
        rows["jacobi_forcing"][0]["identical_to_own_ar"] = 0.5  # Jacobi claims = own AR greedy

    results, _ = write_results(tmp_path, break_risd)
    table = by_decoder(summary.build(summary.load_sources(results), {}))
    risd = table[("idlm_isd", "R-ISD N=3 greedy (gated LoRA)")]
    assert not risd["lossless_verified"] and "99.0%" in risd["lossless"]
    jacobi = table[("jacobi_forcing", "Jacobi n=16 (round 2)")]
    assert not jacobi["lossless_verified"] and "50.0%" in jacobi["lossless"]
    assert table[("idlm_isd", "ISD N=2 greedy")]["lossless_verified"]
    sampled = table[("idlm_isd", "ISD N=4 sample T=1.0")]  # identical here, but claims nothing
    assert not sampled["lossless_verified"] and sampled["lossless"] == "no"


def test_a_missing_results_file_names_it_and_its_command(tmp_path):
    results, _ = write_results(tmp_path)
    (results / "cover.json").unlink()
    with pytest.raises(SystemExit, match=r"cover\.json does not exist: run `python -m pardec\.benchmarks\.cover"):
        summary.load_sources(results)


def test_a_missing_row_names_the_label(tmp_path):
    results, _ = write_results(tmp_path, lambda rows: rows["mdm_flashdlm"].pop(1))
    with pytest.raises(SystemExit, match=r"no row 'MDM Fast-dLLM threshold tau=0\.9 \(prefix cache\)'"):
        summary.build(summary.load_sources(results), {})


def test_conversion_times_come_from_the_results_cpu_conversions(tmp_path):
    """Read from the committed results (runs/ may not outlive the machine), keyed by experiment."""
    (tmp_path / "cpu_conversions.json").write_text(json.dumps({
        "idlm_default": {"wall_seconds": 600.0, "finished": "2026-11-24 10:00:00"},
        "mdm_default": {"wall_seconds": 99.0, "source": "seeded"},
    }))
    assert summary.conversion_seconds(tmp_path) == {"idlm_default": 600.0, "mdm_default": 99.0}
    assert summary.conversion_seconds(tmp_path / "nowhere") == {}


def test_main_writes_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    results, _ = write_results(tmp_path)
    (results / "cpu_conversions.json").write_text(json.dumps(
        {"idlm_default": {"wall_seconds": 600.0, "finished": "2026-11-24 10:00:00"}}))
    out = tmp_path / "out"
    summary.main(["--results-dir", str(results), "--out-dir", str(out)])
    md = (out / "summary.md").read_text()
    saved = json.loads((out / "summary.json").read_text())
    assert len(saved) == len(summary.ROWS)
    isd = "| I-DLM | I-DLM (stride 4) | ISD N=2 greedy | 2.0% | 100.0% | 1.10 | 0.51x | yes (= own AR) | 10.0 min |"
    assert isd in md
    assert "| MDM | MDM | WINO 0.6 / 0.9 | 2.0% | — | 1.10 | — | no | — |" in md
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
