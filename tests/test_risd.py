"""R-ISD end to end: a gated LoRA trained by the real trainer, loaded by validation's checkpoint
loader, decodes with ISD token-identically to the *original* base model's AR greedy."""

from __future__ import annotations

import torch

from pardec.data_pipelines.synthetic_gsm import generate_split
from pardec.data_pipelines.tokenize import format_prompt_ids
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.registry import build_decoder
from pardec.models.gated_lora import gate_holder
from pardec.models.loading import load_model, load_tokenizer
from tests.train_utils import FAST, compose_train, run_in_process


def test_risd_greedy_is_token_identical_to_the_base(tmp_path):
    """Also with a <|mask|> output row that would win every argmax if it were not excluded."""
    cfg = compose_train(FAST + ["recipe=ar"])
    torch.manual_seed(0)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    base_dir = tmp_path / "base"
    load_model(cfg.model, tokenizer, torch.float32, "sdpa").save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=idlm_lora", f"model.path={base_dir}", "model.tokenizer=null",
        "model.config=null", "data.pack_length=512", "trainer.max_steps=3", "trainer.lr=1e-2",
        "recipe.lora_rank=8", "recipe.lora_alpha=16",
    ])
    risd_model, risd_tok = load_checkpoint(result.export_dir, device="cpu")
    base_model, base_tok = load_checkpoint(base_dir, device="cpu")
    assert gate_holder(risd_model).mask_token_id == risd_tok.convert_tokens_to_ids("<|mask|>")
    prompts = [format_prompt_ids(base_tok, row["prompt"], "plain")
               for row in generate_split(cfg.data.synthetic, "test")[:4]]
    eos = {base_tok.eos_token_id}
    ar = build_decoder({"name": "ar", "max_new_tokens": 24}, base_tok).decode(base_model, prompts, eos, [0] * 4)
    # The clean stream of a converted model must never emit <|mask|>, whatever its (random, tied)
    # output row: make that row dominate every clean logit and the outputs must not change.
    mask_id = risd_tok.convert_tokens_to_ids("<|mask|>")
    with torch.no_grad():
        first = base_model(torch.tensor([prompts[0]])).logits[0, -1]  # [V]
        top = int(first.argmax())
        assert first[top] > 0
        head = risd_model.get_output_embeddings().weight
        head[mask_id] = 10 * head[top]  # its logit is now 10x the winning one at that position
    for stride, graphs in [(2, False), (3, False), (4, False), (3, True)]:  # graphs: static steps (eager on CPU)
        isd = build_decoder({"name": "isd", "stride": stride, "max_new_tokens": 24, "cuda_graphs": graphs}, risd_tok)
        out = isd.decode(risd_model, prompts, eos, [0] * 4)
        assert [r.tokens for r in out] == [r.tokens for r in ar], f"stride {stride}, cuda_graphs {graphs}"
    assert all(len(r.tokens) > 0 for r in ar)
