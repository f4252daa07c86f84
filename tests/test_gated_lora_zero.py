"""Gated LoRA (``recipe=idlm_lora``) trained by two processes under torchrun (gloo, CPU) with ZeRO-2
and ZeRO-3: the frozen base is exported bit-identical to the base checkpoint the run started from,
the adapter trained, and the export loads for R-ISD through validation's checkpoint loader and
decodes with ISD token-identically to the base's AR greedy.

Under ZeRO-3 the base is partitioned at load time (``zero.Init``), ``<|mask|>`` is added to the
partitioned embedding, PEFT wraps the partitioned linears, and the export gathers every partition
(``pardec/trainers/export.py``); the model config enables non-reentrant gradient checkpointing, so the
gate replay of :mod:`pardec.models.gated_lora` runs under both stages too.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pardec.data_pipelines.synthetic_gsm import generate_split
from pardec.data_pipelines.tokenize import format_prompt_ids
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.registry import build_decoder
from pardec.models.gated_lora import ADAPTER_SUBDIR, gate_holder
from tests.train_utils import compose_train, exported_weights, logged_metrics, run_torchrun, save_tiny_base

LORA = ["recipe=idlm_lora", "data.pack_length=512", "trainer.max_steps=2", "trainer.lr=1e-2",
        "recipe.lora_rank=8", "recipe.lora_alpha=16", "trainer.grad_accum=1"]


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def base_ar(base_checkpoint):
    """(prompts, the base's AR greedy results) on two held-out problems."""
    cfg = compose_train([])
    model, tokenizer = load_checkpoint(base_checkpoint, device="cpu")
    prompts = [format_prompt_ids(tokenizer, row["prompt"], "plain")
               for row in generate_split(cfg.data.synthetic, "test")[:2]]
    ar = build_decoder({"name": "ar", "max_new_tokens": 24}, tokenizer).decode(
        model, prompts, {tokenizer.eos_token_id}, [0] * len(prompts))
    assert all(len(r.tokens) > 0 for r in ar)
    return prompts, ar


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_gated_lora_two_processes_zero(tmp_path, base_checkpoint, base_ar, zero):
    run_torchrun([f"output_dir={tmp_path}", "model=hf", f"model.path={base_checkpoint}", f"deepspeed={zero}", *LORA],
                 nproc=2, cwd=tmp_path)
    export = tmp_path / "hf"

    # the frozen base: every tensor bit-identical to the base checkpoint (atol 0); the embedding has
    # the one extra <|mask|> row, the only new base tensor
    base = exported_weights(base_checkpoint)
    exported = exported_weights(export)
    assert exported.keys() == base.keys()
    for name, tensor in exported.items():
        assert tensor.numel() > 0, f"{name} exported empty under {zero}"
        if tensor.shape != base[name].shape:
            assert name == "model.embed_tokens.weight" and tensor.shape[0] == base[name].shape[0] + 1, name
            tensor = tensor[: base[name].shape[0]]
        torch.testing.assert_close(tensor, base[name], rtol=0, atol=0, msg=f"{name} changed under {zero}")

    # the adapter trained (lora_B starts at 0) and every one of its tensors was gathered
    adapter = load_file(str(export / ADAPTER_SUBDIR / "adapter_model.safetensors"))
    assert adapter and all(v.numel() > 0 for v in adapter.values())
    assert all(torch.count_nonzero(v) > 0 for k, v in adapter.items() if ".lora_B." in k)

    # R-ISD: the export loads with its gate; greedy ISD equals the base's AR greedy token for token
    model, tokenizer = load_checkpoint(export, device="cpu")
    assert gate_holder(model).mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    prompts, ar = base_ar
    for stride in (2, 3):
        isd = build_decoder({"name": "isd", "stride": stride, "max_new_tokens": 24}, tokenizer)
        out = isd.decode(model, prompts, {tokenizer.eos_token_id}, [0] * len(prompts))
        assert [r.tokens for r in out] == [r.tokens for r in ar], f"stride {stride} under {zero}"
    assert len(logged_metrics(tmp_path)) == 2
