"""A benchmark decoded in chunks (pardec.benchmarks.chunks): the pooled records equal one run's, a
rerun decodes only the missing chunks, a stopped run keeps its finished chunks and says how far it
got, and chunks of another setting or a broken file are refused by name; the committed real-model chunks
are what the reproduce commands fingerprint today."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from pardec.benchmarks import cover, idlm_isd, jacobi_forcing, mdm_flashdlm, refusion
from pardec.benchmarks.chunks import BOUND_FILE, CHUNK_FILES, bound_fingerprint, chunk_bounds, run_in_chunks
from pardec.cli.reproduce import REAL, REAL_STEPS
from tests.conftest import save_chat_checkpoint, stopped_after_first_chunk
from tests.test_mdm_benchmarks_real_flags import chat_mdm_export


def problems(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": f"p{i}"} for i in range(n)])


def fake_rows(subset, first: int = 0) -> dict[str, list[dict]]:
    """Two rows whose records remember which prompt they decoded, numbered from ``first`` as evaluate does
    with ``first_index``."""
    return {key: [{"index": first + i, "prompt": row["prompt"], "row": key} for i, row in enumerate(subset)]
            for key in ("a", "b")}


REAL_CHUNKS = Path(__file__).resolve().parents[1] / REAL / "chunks"


def test_chunk_bounds_cover_every_problem_once():
    for n, size in ((5, 2), (4, 4), (1, 3), (7, 1)):
        bounds = chunk_bounds(n, size)
        covered = [i for first, end in bounds for i in range(first, end)]
        assert covered == list(range(n)) and all(end - first <= size for first, end in bounds)
    with pytest.raises(ValueError, match="--chunk-size"):
        chunk_bounds(3, 0)


def test_chunks_pool_to_one_run_and_resume(tmp_path):
    whole = fake_rows(problems(5))
    pooled = run_in_chunks(problems(5), 2, tmp_path, {"k": 1}, fake_rows)
    assert pooled == whole  # every chunk numbered its problems from its first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000-0002.json", "0002-0004.json", "0004-0005.json"]

    def must_not_run(subset, first):
        raise AssertionError("every chunk is saved: nothing to decode")

    assert run_in_chunks(problems(5), 2, tmp_path, {"k": 1}, must_not_run) == whole

    (tmp_path / "0002-0004.json").unlink()
    decoded = []
    resumed = run_in_chunks(problems(5), 2, tmp_path, {"k": 1},
                            lambda subset, first: decoded.append(subset["prompt"]) or fake_rows(subset, first))
    assert decoded == [["p2", "p3"]] and resumed == whole


def test_a_stopped_run_keeps_finished_chunks_and_reports_progress(tmp_path):
    seen = []

    def stops_at_second_chunk(subset, first):
        if subset[0]["prompt"] == "p2":
            raise KeyboardInterrupt
        return fake_rows(subset, first)

    with pytest.raises(KeyboardInterrupt):
        run_in_chunks(problems(5), 2, tmp_path, {"k": 1}, stops_at_second_chunk,
                      on_chunk=lambda records, done, machine: seen.append((len(records["a"]), done)))
    assert seen == [(2, 2)]
    assert [p.name for p in tmp_path.iterdir()] == ["0000-0002.json"]  # no half-written chunk


def test_a_pooled_table_names_the_machines_that_decoded_its_chunks(tmp_path, monkeypatch):
    """Each chunk records the machine that decoded it; read back elsewhere, the table names the chunks'
    machine, not the reader's; chunks of several machines (or from before chunks recorded one) are
    named with the problems each decoded, and write_results puts that in the table and machines.json."""
    import pardec.benchmarks.chunks as chunks
    from pardec.benchmarks.common import MACHINES, write_results

    first = {"cpu": "CPU A, 2 cores", "gpu": None, "torch": "2.0"}
    monkeypatch.setattr(chunks, "current_machine", lambda: first)
    seen = []
    run_in_chunks(problems(6), 2, tmp_path, {"k": 1}, fake_rows, on_chunk=lambda r, done, m: seen.append(m))
    assert seen == [first] * 3
    assert json.loads((tmp_path / "0002-0004.json").read_text())["machine"] == first

    monkeypatch.setattr(chunks, "current_machine", lambda: {"cpu": "CPU B, 8 cores", "gpu": "GPU G", "torch": "2.1"})
    seen.clear()
    run_in_chunks(problems(6), 2, tmp_path, {"k": 1}, fake_rows, on_chunk=lambda r, done, m: seen.append(m))
    assert seen == [first] * 3  # every chunk read back: the reader's machine is not named

    (tmp_path / "0002-0004.json").unlink()
    saved = json.loads((tmp_path / "0004-0006.json").read_text())
    del saved["machine"]  # as the chunks written before chunks recorded their machine
    (tmp_path / "0004-0006.json").write_text(json.dumps(saved))
    seen.clear()
    run_in_chunks(problems(6), 2, tmp_path, {"k": 1}, fake_rows, on_chunk=lambda r, done, m: seen.append(m))
    mixed = "CPU A, 2 cores, torch 2.0 (problems 0-2); GPU G, CPU B, 8 cores, torch 2.1 (problems 2-4); " \
            "not recorded (problems 4-6)"
    assert seen[-1] == {"cpu": mixed, "gpu": None, "torch": None}

    write_results(tmp_path / "out" / "table", "cmd", "body", [], machine=seen[-1])
    assert (tmp_path / "out" / "table.md").read_text().splitlines()[1] == f"Machine: {mixed}"
    assert json.loads((tmp_path / "out" / MACHINES).read_text())["table"]["cpu"] == mixed

    for path in tmp_path.glob("*.json"):  # every chunk from before chunks recorded their machine
        saved = json.loads(path.read_text())
        saved.pop("machine", None)
        path.write_text(json.dumps(saved))
    seen.clear()
    run_in_chunks(problems(6), 2, tmp_path, {"k": 1}, fake_rows, on_chunk=lambda r, done, m: seen.append(m))
    assert seen[-1] == {"cpu": None, "gpu": None, "torch": None}  # the summary's "not recorded"
    write_results(tmp_path / "out" / "old", "cmd", "body", [], machine=seen[-1])
    assert (tmp_path / "out" / "old.md").read_text().splitlines()[1] == "Machine: not recorded"


def test_chunks_of_another_setting_or_broken_are_refused(tmp_path):
    run_in_chunks(problems(2), 1, tmp_path, {"rows": ("a", 1)}, fake_rows)
    assert run_in_chunks(problems(2), 1, tmp_path, {"rows": ("a", 1)}, fake_rows) == fake_rows(problems(2))
    with pytest.raises(ValueError, match=r"0000-0001.json.*another setting \(rows: \['a', 1\] -> \['a', 2\]\)"):
        run_in_chunks(problems(2), 1, tmp_path, {"rows": ("a", 2)}, fake_rows)
    (tmp_path / "0000-0001.json").write_text("{not json")
    with pytest.raises(ValueError, match="0000-0001.json is not valid JSON"):
        run_in_chunks(problems(2), 1, tmp_path, {"rows": ("a", 1)}, fake_rows)


def test_chunks_name_checkpoints_by_content(tmp_path):
    """A checkpoint re-built with the same bytes (a later session's) is the same checkpoint; one file
    changed is refused, naming the checkpoint and the file; its README and the ``eval/`` runs
    ``pardec-validate`` writes into it are not compared."""
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    for name, content in (("model.safetensors", b"w1"), ("config.json", b"{}"), ("README.md", b"made at noon")):
        (ckpt / name).write_bytes(content)
    chunks = tmp_path / "chunks"
    run_in_chunks(problems(2), 1, chunks, {"k": 1}, fake_rows, checkpoints=[ckpt])
    saved = json.loads((chunks / "0000-0001.json").read_text())["fingerprint"]
    assert set(saved["checkpoint_sha256"][str(ckpt)]) == {"model.safetensors", "config.json"}

    def must_not_run(subset, first):
        raise AssertionError("the same bytes: nothing to decode")

    for name in ("model.safetensors", "README.md"):  # rewritten: same weights, another README
        (ckpt / name).write_bytes(b"w1" if name == "model.safetensors" else b"made at midnight")
    (ckpt / "eval" / "ar_greedy").mkdir(parents=True)  # validated after the chunks were decoded
    (ckpt / "eval" / "ar_greedy" / "metrics.json").write_text('{"tps": 23.5}')
    assert run_in_chunks(problems(2), 1, chunks, {"k": 1}, must_not_run, checkpoints=[ckpt]) == fake_rows(problems(2))
    (ckpt / "adapter").mkdir()  # a file in any other folder (a gated LoRA's adapter) is the checkpoint's
    (ckpt / "adapter" / "adapter_model.safetensors").write_bytes(b"a1")
    with pytest.raises(ValueError, match=f"0000-0001.json.*checkpoint {ckpt}: adapter/adapter_model.safetensors"):
        run_in_chunks(problems(2), 1, chunks, {"k": 1}, must_not_run, checkpoints=[ckpt])
    (ckpt / "adapter" / "adapter_model.safetensors").unlink()
    (ckpt / "model.safetensors").write_bytes(b"w2")
    with pytest.raises(ValueError, match=f"0000-0001.json.*checkpoint {ckpt}: model.safetensors differs\\)"):
        run_in_chunks(problems(2), 1, chunks, {"k": 1}, must_not_run, checkpoints=[ckpt])


def test_mdm_flashdlm_in_chunks_equals_one_run(tmp_path, monkeypatch):
    """Everything but time is the same pooled from chunks of one problem as decoded in one go; a run
    stopped after its first chunk leaves a table of that chunk saying so, and a rerun finishes it."""
    import pardec.benchmarks.chunks as chunks
    import pardec.benchmarks.mdm_flashdlm as bench

    base, mdm = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm")
    args = ["--base", str(base), "--mdm", str(mdm), "--num-samples", "3", "--gen-length", "8", "--block-size", "4",
            "--rows", "ar,lowconf1,guided_shifted", "--template", "chat", "--threads", "1"]
    bench.main([*args, "--out", str(tmp_path / "one")])

    chunked = stopped_after_first_chunk(monkeypatch, bench, args, tmp_path, rows=3, problems=3,
                                        decoding=chunks)
    bench.main(chunked)
    one, pooled = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "c"))
    assert "problems done" not in (tmp_path / "c.md").read_text()
    timeless = ("tps", "tps_vs_mdm_baseline", "tps_vs_base_ar")
    assert [{k: v for k, v in r.items() if k not in timeless} for r in pooled] == \
           [{k: v for k, v in r.items() if k not in timeless} for r in one]
    assert pooled[2]["identical_to_base_ar"] == 1.0  # guided shifted = base AR greedy, pooled over chunks


def test_cover_in_chunks_with_base_equals_one_run(tmp_path):
    """COVER's test rows pooled from chunks of one problem equal one run's, time aside; with --base the
    AR greedy row comes first and every row has its TPS / base AR."""
    from pardec.benchmarks.cover import AR_LABEL, main

    base, mdm = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm")
    args = ["--mdm", str(mdm), "--base", str(base), "--num-samples", "2", "--num-validation", "1",
            "--max-new-tokens", "8", "--block-size", "4", "--taus", "0.9", "--template", "chat", "--threads", "1"]
    main([*args, "--out", str(tmp_path / "one")])
    main([*args, "--chunk-dir", str(tmp_path / "chunks"), "--chunk-size", "1", "--out", str(tmp_path / "c")])
    one, pooled = (json.loads((tmp_path / f"{name}.json").read_text())["test"] for name in ("one", "c"))
    assert [r["decoder"] for r in one][:2] == [AR_LABEL, "LLaDA low-confidence, 1 token/step (baseline)"]
    assert one[0]["tps_vs_base_ar"] == 1.0 and all(r["tps_vs_base_ar"] > 0 for r in one)
    timeless = ("tps", "tps_ratio", "tps_vs_base_ar", "seconds")
    assert [{k: v for k, v in r.items() if k not in timeless} for r in pooled] == \
           [{k: v for k, v in r.items() if k not in timeless} for r in one]
    assert sorted(p.name for p in (tmp_path / "chunks").iterdir()) == [
        "0000-0001.json", "0001-0002.json", cover.VALIDATION_FILE]
    assert "TPS / base AR" in (tmp_path / "c.md").read_text()
    # = base AR greedy, recounted from the saved outputs: problems whose tokens equal the AR row's
    saved = [json.loads(p.read_text())["rows"] for p in sorted((tmp_path / "chunks").glob(CHUNK_FILES))]
    for r in pooled:
        same = [c[r["decoder"]][0]["output_ids"] == c[AR_LABEL][0]["output_ids"] for c in saved]
        assert r["identical_to_base_ar"] == sum(same) / len(same)
    assert pooled[0]["identical_to_base_ar"] == 1.0 and "= base AR greedy" in (tmp_path / "c.md").read_text()


def test_cover_keeps_its_validation_sweep_and_names_its_machine_apart_from_the_chunks_machine(tmp_path, monkeypatch):
    """COVER's validation sweep is kept beside the chunks and read back, not swept again: a run that goes on
    from chunks decoded elsewhere names the chunks' machine on its Machine line and the sweep's (also
    ``validation_machine`` in the JSON) in the validation section, with the file it was read from; a
    sweep of other settings is refused by name."""
    import pardec.benchmarks.chunks as chunks
    import pardec.benchmarks.cover as cover
    from pardec.benchmarks.common import machine_name

    elsewhere = {"cpu": "CPU E, 64 cores", "gpu": None, "torch": "2.0"}
    mdm = chat_mdm_export(tmp_path / "mdm")
    args = ["--mdm", str(mdm), "--num-samples", "2", "--num-validation", "1", "--max-new-tokens", "8",
            "--block-size", "4", "--taus", "0.9", "--template", "chat", "--threads", "1",
            "--chunk-dir", str(tmp_path / "chunks"), "--chunk-size", "1", "--out", str(tmp_path / "c")]
    monkeypatch.setattr(chunks, "current_machine", lambda: elsewhere)
    monkeypatch.setattr(cover, "current_machine", lambda: elsewhere)
    cover.main(args)  # the sweep and the chunks, decoded "elsewhere"
    first = json.loads((tmp_path / "c.json").read_text())
    monkeypatch.undo()

    def swept_again(*a, **k):
        raise AssertionError("the validation sweep ran again")

    monkeypatch.setattr(cover, "run", swept_again)
    cover.main(args)  # read back here: nothing decoded
    lines = (tmp_path / "c.md").read_text().splitlines()
    path = tmp_path / "chunks" / cover.VALIDATION_FILE
    assert lines[1] == f"Machine: {machine_name(elsewhere)}"
    assert f"Validation (COVER; read from {path}, made on {machine_name(elsewhere)}):" in lines
    again = json.loads((tmp_path / "c.json").read_text())
    assert again["validation_machine"] == elsewhere and again == first
    with pytest.raises(ValueError, match="validation.json was made by another setting"):
        cover.main([*args[:args.index("--taus") + 1], "0.8", *args[args.index("--taus") + 2:]])


# -- the committed real-model chunks --------------------------------------------------------------


def committed_fingerprint(step_name: str) -> dict:
    chunk = json.loads(next(iter(sorted((REAL_CHUNKS / step_name).glob(CHUNK_FILES)))).read_text())
    return {k: v for k, v in chunk["fingerprint"].items() if k not in ("torch", "checkpoint_sha256")}


def kept_fingerprint(step_name: str, name: str) -> dict:
    """The fingerprint of what a chunked step keeps beside its chunks (pardec.benchmarks.chunks.kept_in)."""
    saved = json.loads((REAL_CHUNKS / step_name / name).read_text())["fingerprint"]
    return {k: v for k, v in saved.items() if k not in ("torch", "checkpoint_sha256")}


def step_args(step_name: str) -> list[str]:
    step = next(s for s in REAL_STEPS if s.name == step_name)
    return step.command[step.command.index("-m") + 2:]


# recipe.block_size of experiment smollm2_mdm_lora_2000 (the FlashDLM and COVER tables'): the decoding block both
# commands default to
MDM_BLOCK = 2
MDM_BLOCK8 = 8  # that of smollm2_mdm_lora_2000_block8 (the block-8 FlashDLM and COVER tables')
JACOBI_ROUND1_BLOCK = 8  # the round-1 block size of experiment smollm2_jacobi_forcing_lora_1500 (its trained n)
REFUSION_SLOT = 8  # recipe.export_slot_size of experiment smollm2_refusion_lora_3000 (the checkpoint's slot size)


def test_the_reproduce_commands_still_make_the_committed_chunks_fingerprints():
    """``pardec.cli.reproduce --real`` goes on from the committed chunks only when its commands fingerprint
    them as they were made (a new config key, even at its default, would have every chunk refused): the
    R-ISD, I-DLM, Jacobi Forcing, ReFusion, FlashDLM and COVER tables' settings today against their first chunk's (the
    torch version and the checkpoints' digests, added when decoding, aside)."""
    args = idlm_isd.parse_args(step_args("cpu_risd"))
    stride = json.loads((REAL_CHUNKS.parent / "cpu_risd.json").read_text())[-1]["stride"]  # the gated LoRA's
    rows = idlm_isd.table_rows(args, args.strides, stride)
    assert json.loads(json.dumps(idlm_isd.chunk_fingerprint(args, rows))) == committed_fingerprint("cpu_risd")
    assert kept_fingerprint("cpu_risd", BOUND_FILE) == bound_fingerprint(args, "idlm_isd", [1, 2 * stride - 1])

    args = idlm_isd.parse_args(step_args("cpu_idlm"))
    committed = json.loads((REAL_CHUNKS.parent / "cpu_idlm.json").read_text())
    rows = idlm_isd.table_rows(args, committed["test_strides"], None)  # the N val chose (kept), and N = 4
    assert json.loads(json.dumps(idlm_isd.chunk_fingerprint(args, rows))) == committed_fingerprint("cpu_idlm")
    val_rows = [idlm_isd.base_ar_row(args), *idlm_isd.isd_rows(args, args.strides, False)]
    assert kept_fingerprint("cpu_idlm", idlm_isd.VALIDATION_FILE) == json.loads(json.dumps(
        {**idlm_isd.chunk_fingerprint(args, val_rows), "split": "val", "num_val": args.num_val}))
    widths = [1, *(2 * n - 1 for n in sorted({*args.strides, *args.test_strides}))]
    assert kept_fingerprint("cpu_idlm", BOUND_FILE) == bound_fingerprint(args, "idlm_isd", widths)

    args = jacobi_forcing.parse_args(step_args("cpu_jacobi_forcing"))
    committed = json.loads((REAL_CHUNKS.parent / "cpu_jacobi_forcing.json").read_text())
    trained = {"round1": JACOBI_ROUND1_BLOCK}
    rows = jacobi_forcing.decoding_rows(args, trained, committed["chosen_block_size"],
                                        committed["chosen_multiblock_block_size"])
    assert json.loads(json.dumps(jacobi_forcing.chunk_fingerprint(args, rows))) == committed_fingerprint(
        "cpu_jacobi_forcing")
    val_rows = jacobi_forcing.validation_rows_for_n(args, trained)
    assert kept_fingerprint("cpu_jacobi_forcing", jacobi_forcing.VALIDATION_FILE) == json.loads(json.dumps(
        {**jacobi_forcing.chunk_fingerprint(args, val_rows), "split": "val", "num_val": args.num_val}))
    widths = [1, *sorted({d["block_size"] for _, _, d in [*val_rows, *jacobi_forcing.decoding_rows(args, trained, None)]
                          if d["name"] == "jacobi"})]
    assert kept_fingerprint("cpu_jacobi_forcing", BOUND_FILE) == bound_fingerprint(args, "jacobi_forcing", widths)

    args = refusion.parse_args(step_args("cpu_refusion"))
    val_rows = refusion.sweep_rows(args, REFUSION_SLOT)
    val_fingerprint = {**refusion.chunk_fingerprint(args, val_rows, "val"), "num_val": args.num_val}
    assert kept_fingerprint("cpu_refusion", refusion.VALIDATION_FILE) == json.loads(json.dumps(val_fingerprint))
    kept = json.loads((REAL_CHUNKS / "cpu_refusion" / refusion.VALIDATION_FILE).read_text())["rows"]
    chosen, _ = refusion.choose_setting(kept, args.max_drop)  # the choice the committed sweep makes
    rows = refusion.report_rows(args, chosen, REFUSION_SLOT)
    assert json.loads(json.dumps(refusion.chunk_fingerprint(args, rows, args.split))) == committed_fingerprint(
        "cpu_refusion")

    for step_name, block in (("cpu_mdm_flashdlm", MDM_BLOCK), ("cpu_mdm_flashdlm_block8", MDM_BLOCK8)):
        args = mdm_flashdlm.parse_args(step_args(step_name))
        args.block_size = block
        assert mdm_flashdlm.chunk_fingerprint(args, mdm_flashdlm.selected_rows(args)) == committed_fingerprint(
            step_name)

    for step_name, block in (("cpu_cover", MDM_BLOCK), ("cpu_cover_block8", MDM_BLOCK8)):
        args = cover.parse_args(step_args(step_name))
        args.block_size = block
        committed = json.loads((REAL_CHUNKS.parent / f"{step_name}.json").read_text())
        bar = max((r["accuracy"] for r in committed["validation_baselines"]), default=None)  # --select baselines
        tau = cover.choose_tau(committed["validation"], args.select, bar)["tau_draft"]  # the committed run's choice
        rows = cover.table_rows(args, tau)
        assert json.loads(json.dumps(cover.chunk_fingerprint(args, rows))) == committed_fingerprint(step_name)
        if (REAL_CHUNKS / step_name / cover.VALIDATION_FILE).exists():  # kept since 2026-12-07
            assert kept_fingerprint(step_name, cover.VALIDATION_FILE) == json.loads(json.dumps(
                cover.validation_fingerprint(args)))
    assert (REAL_CHUNKS / "cpu_cover_block8" / cover.VALIDATION_FILE).exists()
