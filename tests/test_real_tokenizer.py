"""A real model's tokenizer through every recipe and decoder: byte-level BPE, a chat template whose
turn ends with a token that is not EOS, no pad, no ``<|mask|>``, tied embeddings (a tiny random
Llama with :func:`tests.conftest.chat_bpe_tokenizer`, as SmolLM2 and Qwen look to pardec).

References are computed another way: the end of turn against the rendered template's text, the
tie against the tensors' storage, lossless decoders against AR greedy (``evaluate``'s reference run),
the stop against a model forced to end its turn at once."""

from __future__ import annotations

import datasets
import pytest
import torch

from pardec.common.constants import MASK_TOKEN
from pardec.common.errors import DataError
from pardec.common.metadata import CheckpointMetadata
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import (
    end_of_turn_token_id,
    format_prompt_ids,
    resolve_template,
    stop_token_ids,
    tokenize_dataset,
)
from pardec.inference.evaluate import evaluate
from pardec.methods.registry import _RECIPES, build_method
from pardec.models.loading import add_mask_token, load_model, load_tokenizer
from pardec.trainers.trainer import expand_stages
from tests.conftest import EVAL_ROWS, chat_bpe_tokenizer, save_chat_checkpoint, tiny_tokenizer
from tests.train_utils import compose_train


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("chat_llama"))


def hf_cfg(ckpt, *overrides):
    return compose_train(["model=hf", f"model.path={ckpt}", "model.gradient_checkpointing=false",
                          "data.template=chat", "data.synthetic.num_train=8", "data.max_length=256",
                          "data.pack_length=512", *overrides])


def test_end_of_turn_is_read_off_the_chat_template():
    tok = chat_bpe_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                       tokenize=False)
    assert rendered.endswith("b<|im_end|>\n")  # the template's own text: the turn ends with <|im_end|>
    assert im_end != tok.eos_token_id
    assert end_of_turn_token_id(tok) == im_end
    assert stop_token_ids(tok) == {tok.eos_token_id, im_end}
    assert end_of_turn_token_id(tiny_tokenizer()) is None  # no chat template: EOS alone
    assert stop_token_ids(tiny_tokenizer()) == {tiny_tokenizer().eos_token_id}


def test_template_auto_is_chat_for_a_chat_tokenizer_and_plain_otherwise():
    chat, plain = chat_bpe_tokenizer(), tiny_tokenizer()
    assert resolve_template(chat, "auto") == "chat" and resolve_template(plain, "auto") == "plain"
    prompt = "Question: what is 1 plus 2 ? Answer:"
    assert format_prompt_ids(chat, prompt, "auto") == chat.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert format_prompt_ids(plain, prompt, "auto") == plain(prompt, add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match="data.template=chat"):
        format_prompt_ids(plain, prompt, "chat")


def test_mask_token_is_added_resized_tied_and_survives_export(chat_ckpt, tmp_path):
    cfg = hf_cfg(chat_ckpt, "recipe=idlm")
    tok = load_tokenizer(cfg.model, cfg.data)
    assert tok.pad_token_id == tok.eos_token_id  # chosen explicitly: no pad of its own
    model = load_model(cfg.model, tok, torch.float32, "sdpa")
    n_before = len(tok)
    old_rows = model.get_input_embeddings().weight.detach().clone()
    assert MASK_TOKEN not in tok.get_vocab()

    mask_id = add_mask_token(model, tok)

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert mask_id == n_before and len(tok) == n_before + 1 == embed.shape[0]
    assert head.data_ptr() == embed.data_ptr()  # still one tensor: tied weights stay tied
    torch.testing.assert_close(embed[:n_before], old_rows, rtol=0, atol=0)  # old rows untouched
    assert torch.isfinite(embed[mask_id]).all() and embed[mask_id].abs().sum() > 0
    assert CheckpointMetadata.of_model(model).mask_token_id == mask_id

    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded_cfg = hf_cfg(tmp_path, "recipe=idlm")
    tok2 = load_tokenizer(reloaded_cfg.model, reloaded_cfg.data)
    model2 = load_model(reloaded_cfg.model, tok2, torch.float32, "sdpa")
    assert tok2.convert_tokens_to_ids(MASK_TOKEN) == mask_id == CheckpointMetadata.of_model(model2).mask_token_id
    assert tok2.chat_template == tok.chat_template and end_of_turn_token_id(tok2) == end_of_turn_token_id(tok)
    assert model2.get_output_embeddings().weight.data_ptr() == model2.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(model2.get_input_embeddings().weight, embed.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", sorted(_RECIPES))
def test_each_recipe_trains_a_batch_with_the_chat_tokenizer(recipe, chat_ckpt, tmp_path):
    extra = [f"recipe.collect_dir={tmp_path / 'traj'}", "recipe.max_new_tokens=16",
             "recipe.stages=[]", "recipe.block_size=8", "recipe.window=8"] if recipe == "jacobi_forcing" else []
    cfg = expand_stages(hf_cfg(chat_ckpt, f"recipe={recipe}", f"output_dir={tmp_path}", *extra))[0]
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model, cfg.data)
    method = build_method(cfg.recipe, tok)
    tokenized = tokenize_dataset(load_raw_split(cfg.data, "train"), tok, cfg.data, "train", method.trains_on_responses)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(im_end in ids for ids in tokenized["input_ids"])  # every response ends its turn
    model = method.prepare_model(load_model(cfg.model, tok, torch.float32, "sdpa"))
    if recipe in ("idlm", "idlm_lora", "mdm", "refusion"):
        assert CheckpointMetadata.of_model(model).mask_token_id == tok.convert_tokens_to_ids(MASK_TOKEN)
    train_ds = method.build_train_dataset(tokenized, cfg.data, model)
    batch = method.collate([train_ds[i] for i in range(min(2, len(train_ds)))])
    model.train()
    loss, logs = method.loss(model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# decoder config -> the checkpoint metadata the decoder reads (what the matching recipe's export records)
DECODERS = {
    "ar": ({"name": "ar"}, {}),
    "jacobi": ({"name": "jacobi", "block_size": 4}, {}),
    "multiblock": ({"name": "multiblock", "block_size": 4}, {}),
    "isd": ({"name": "isd", "stride": 3}, {"recipe": "idlm", "isd_stride": 3}),
    "refusion": ({"name": "refusion", "slot_size": 4, "block_size": 16}, {"recipe": "refusion", "slot_size": 4}),
    "mdm_lowconf": ({"name": "mdm_lowconf", "block_size": 8},
                    {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
    "mdm_threshold": ({"name": "mdm_threshold", "block_size": 8},
                      {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
    "mdm_guided": ({"name": "mdm_guided", "block_size": 8},
                   {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
    "cover": ({"name": "cover", "block_size": 8}, {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
    "wino": ({"name": "wino", "block_size": 8}, {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
    "saber": ({"name": "saber", "block_size": 8}, {"recipe": "mdm", "attention": "bidirectional", "logit_shift": True}),
}
LOSSLESS = ("jacobi", "multiblock", "isd")


def chat_model(ckpt, metadata: dict):
    cfg = hf_cfg(ckpt)
    tok = load_tokenizer(cfg.model, cfg.data)
    model = load_model(cfg.model, tok, torch.float32, "sdpa").eval()
    if "recipe" in metadata and metadata["recipe"] != "jacobi_forcing":
        add_mask_token(model, tok)
    CheckpointMetadata.of_model(model).updated(**metadata).write_to(model)
    return model, tok


def run(model, tok, decoder_cfg, rows=EVAL_ROWS[:2], guide=None, **kwargs):
    """``guide``: the causal AR guide of ``mdm_guided`` (the base the MDM was converted from)."""
    cfg = {**decoder_cfg, "max_new_tokens": 16}
    if guide is not None:
        cfg["guide"] = guide.config._name_or_path
    return evaluate(model, tok, datasets.Dataset.from_list(rows), cfg, template="chat", shard=False,
                    auxiliary={"guide": guide} if guide is not None else None, **kwargs)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_each_decoder_stops_at_the_chat_end_of_turn(name, chat_ckpt):
    """A model whose every position prefers ``<|im_end|>`` (a logit hook): each decoder's answer is
    that one token, so decoding stops at the end of turn although it is not the tokenizer's EOS."""
    decoder_cfg, metadata = DECODERS[name]
    model, tok = chat_model(chat_ckpt, metadata)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def prefer_end_of_turn(module, args, output):
        output[..., im_end] += 100.0
        return output

    guide = chat_model(chat_ckpt, {})[0] if name == "mdm_guided" else None
    handles = [m.get_output_embeddings().register_forward_hook(prefer_end_of_turn) for m in (model, guide) if m]
    try:
        result = run(model, tok, decoder_cfg, guide=guide, agreement=False)
    finally:
        for handle in handles:
            handle.remove()
    for record in result.records:
        assert record["output_ids"] == [im_end], (name, record["output_ids"])
        assert record["hit_eos"]


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_decoders_equal_ar_greedy_on_chat_prompts(name, chat_ckpt):
    decoder_cfg, metadata = DECODERS[name]
    model, tok = chat_model(chat_ckpt, metadata)
    result = run(model, tok, decoder_cfg, rows=EVAL_ROWS[:3])
    assert result.metrics["agreement_exact"] == 1.0
    for record in result.records:
        assert record["output_ids"] == record["reference_ids"] and len(record["output_ids"]) == 16


def test_evaluate_renders_a_chat_models_prompts_through_its_template_by_default(chat_ckpt):
    """evaluate()'s default template is ``auto`` (as data.template): a benchmark that names none feeds a
    chat model the chat-rendered prompt it was trained on, and the embedded tokenizer its plain prompt."""
    model, tok = chat_model(chat_ckpt, {})
    rows = datasets.Dataset.from_list(EVAL_ROWS[:2])
    decoder = {"name": "ar", "max_new_tokens": 2}
    records = evaluate(model, tok, rows, decoder, shard=False, agreement=False).records
    for record in records:
        chat = format_prompt_ids(tok, record["prompt"], "chat")
        assert record["prompt_tokens"] == len(chat) != len(format_prompt_ids(tok, record["prompt"], "plain"))
