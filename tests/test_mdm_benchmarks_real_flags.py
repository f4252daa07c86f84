"""The MDM benchmarks (mdm_flashdlm, cover) with the real-model flags on tiny chat checkpoints:
chat prompts, device and dtype, argv; the guided-shifted row reproduces the base's AR greedy."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.common.constants import MASK_TOKEN
from pardec.common.metadata import CheckpointMetadata
from tests.conftest import chat_bpe_tokenizer, save_chat_checkpoint, tiny_model


def chat_mdm_export(path):
    tok = chat_bpe_tokenizer()
    tok.add_tokens([MASK_TOKEN], special_tokens=True)
    model = tiny_model(len(tok), "llama", 1, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       pad_token_id=None)
    CheckpointMetadata(recipe="mdm", attention="block", attention_block_size=2, logit_shift=True,
                       mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN)).write_to(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_mdm_flashdlm_real_model_flags(tmp_path):
    from pardec.benchmarks.mdm_flashdlm import main

    base, mdm, out = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm"), tmp_path / "r"
    main(["--base", str(base), "--mdm", str(mdm), "--num-samples", "2", "--gen-length", "8", "--block-size", "4",
          "--rows", "ar,lowconf1,fc_refresh,guided_shifted", "--template", "chat", "--device", "cpu",
          "--dtype", "float32", "--threads", "1", "--out", str(out)])
    rows = {r["key"]: r for r in json.loads(out.with_suffix(".json").read_text())}
    assert list(rows) == ["ar", "lowconf1", "fc_refresh", "guided_shifted"]
    assert rows["guided_shifted"]["identical_to_base_ar"] == 1.0
    text = out.with_suffix(".md").read_text()
    assert "template chat" in text and "--rows ar,lowconf1,fc_refresh,guided_shifted" in text  # main(argv)'s command


def test_mdm_flashdlm_refuses_an_unknown_row_key_by_name():
    from pardec.benchmarks.mdm_flashdlm import parse_args, selected_rows

    args = parse_args(["--base", "b", "--mdm", "m", "--block-size", "4", "--rows", "ar,fc_guided,lowconf1"])
    with pytest.raises(SystemExit, match=r"unknown row key\(s\) fc_guided; known: ar, lowconf1, "):
        selected_rows(args)


def test_mdm_flashdlm_with_cuda_graphs_measures_what_eager_decoding_measures(tmp_path):
    """--cuda-graphs: every row (AR, MDM and guide) over static steps; on CPU they run eagerly, so every
    column but the timings equals the eager run's."""
    from pardec.benchmarks.mdm_flashdlm import main

    base, mdm = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm")
    tables = {}
    for flags in ([], ["--cuda-graphs"]):
        out = tmp_path / f"r{len(flags)}"
        main(["--base", str(base), "--mdm", str(mdm), "--num-samples", "2", "--gen-length", "8", "--block-size", "4",
              "--template", "chat", "--threads", "1", "--out", str(out), *flags])
        tables[bool(flags)] = json.loads(out.with_suffix(".json").read_text())
    timed = {"tps", "tps_vs_mdm_baseline", "tps_vs_base_ar", "config"}
    assert len(tables[True]) == len(tables[False]) == 9
    for graphs, eager in zip(tables[True], tables[False]):
        assert graphs["config"] == {**eager["config"], "cuda_graphs": True} and "cuda_graphs" not in eager["config"]
        assert {k: v for k, v in graphs.items() if k not in timed} == {k: v for k, v in eager.items() if k not in timed}
    assert "every decode step a CUDA graph" in (tmp_path / "r1.md").read_text()


def test_cover_real_model_flags(tmp_path):
    from pardec.benchmarks.cover import main

    mdm, out = chat_mdm_export(tmp_path / "mdm"), tmp_path / "r"
    main(["--mdm", str(mdm), "--num-samples", "2", "--num-validation", "2", "--max-new-tokens", "8",
          "--block-size", "4", "--taus", "0.9", "--template", "chat", "--dtype", "float32", "--out", str(out)])
    text = out.with_suffix(".md").read_text()
    assert "COVER tau=0.9 without override" in text
    assert "= base AR greedy" not in text  # no --base: no AR row to compare with
    assert "--taus 0.9 --template chat" in text and "float32 on cpu" in text


def test_cover_with_cuda_graphs_measures_what_eager_decoding_measures(tmp_path):
    """--cuda-graphs: every row (AR, the MDM decoders, COVER's static override forwards; validation too); on
    CPU they run eagerly, so every column but the timings equals the eager run's."""
    from pardec.benchmarks.cover import main

    base, mdm = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm")
    tables = {}
    for flags in ([], ["--cuda-graphs"]):
        out = tmp_path / f"c{len(flags)}"
        main(["--base", str(base), "--mdm", str(mdm), "--num-samples", "2", "--num-validation", "2",
              "--max-new-tokens", "8", "--block-size", "4", "--taus", "0.5,0.9", "--template", "chat",
              "--out", str(out), *flags])
        tables[bool(flags)] = json.loads(out.with_suffix(".json").read_text())
    timed = {"tps", "tps_ratio", "tps_vs_base_ar", "seconds"}
    for part in ("validation", "test"):
        assert len(tables[True][part]) == len(tables[False][part]) > 1
        for graphs, eager in zip(tables[True][part], tables[False][part]):
            untimed = {k: v for k, v in eager.items() if k not in timed}
            assert {k: v for k, v in graphs.items() if k not in timed} == untimed
    assert "every forward a CUDA graph" in (tmp_path / "c1.md").read_text()  # the setting every row shares
    assert "--cuda-graphs" in (tmp_path / "c1.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mdm_benchmarks_every_row_on_cuda(tmp_path):
    """Every MDM decoder row of both benchmarks runs on CUDA (fp32), and guided-shifted still
    reproduces the base's AR greedy there, eagerly and with every step (COVER's forwards too) a CUDA graph."""
    from pardec.benchmarks.cover import main as cover
    from pardec.benchmarks.mdm_flashdlm import main as flashdlm

    base, mdm = save_chat_checkpoint(tmp_path / "base"), chat_mdm_export(tmp_path / "mdm")
    for flags in ([], ["--cuda-graphs"]):
        flashdlm(["--base", str(base), "--mdm", str(mdm), "--num-samples", "2", "--gen-length", "8", "--block-size",
                  "4", "--template", "chat", "--device", "cuda", "--dtype", "float32", "--out", str(tmp_path / "f"),
                  *flags])
        rows = {r["key"]: r for r in json.loads((tmp_path / "f.json").read_text())}
        assert len(rows) == 9 and rows["guided_shifted"]["identical_to_base_ar"] == 1.0, flags
    for flags in ([], ["--cuda-graphs"]):
        cover(["--mdm", str(mdm), "--num-samples", "2", "--num-validation", "2", "--max-new-tokens", "8",
               "--block-size", "4", "--taus", "0.9", "--template", "chat", "--device", "cuda",
               "--out", str(tmp_path / "c"), *flags])
        assert len(json.loads((tmp_path / "c.json").read_text())["test"]) == 7, flags
