"""The decoder lifecycle (``pardec.inference.decoders.base``): ``prepare`` swaps and restores the model's
attention around a decoder's run, ``summarize`` defaults to nothing, auxiliary models are handed
over by name, attention names are checked against transformers' registry, and decoders take their
defaults from the checkpoint metadata."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import datasets
import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.inference.decoders import registry
from pardec.inference.decoders.ar import ARDecoder, ARDecoderConfig
from pardec.inference.decoders.jacobi import JacobiDecoder, JacobiDecoderConfig
from pardec.inference.evaluate import evaluate
from pardec.models.loading import check_attn_implementation
from tests.conftest import EVAL_ROWS, tiny_model, tiny_tokenizer

SWAPPED = "pardec_test_reversed_keys"


def reversed_keys_attention(module, query, key, value, attention_mask, **kwargs):
    """A deliberately different attention (keys and values reversed along the sequence, no mask):
    outputs change, so a test can tell whether it is installed."""
    return sdpa_attention_forward(module, query, key.flip(-2), value.flip(-2), None, **{**kwargs, "is_causal": False})


@dataclass
class SwapConfig(ARDecoderConfig):
    name: str = "swap_test"
    fail: bool = False


class SwapAttentionDecoder(ARDecoder):
    """AR greedy under a custom attention registered with ``AttentionInterface`` in ``prepare``; each
    ``decode`` call records whether SDPA may pick cuDNN attention (``cudnn_seen``)."""

    name = "swap_test"
    cudnn_seen: list[bool] = []

    @property
    def is_ar_greedy(self) -> bool:  # not the reference: evaluate also runs AR greedy for agreement
        return False

    @contextlib.contextmanager
    def prepare(self, model):
        AttentionInterface.register(SWAPPED, reversed_keys_attention)
        previous = model.config._attn_implementation
        model.set_attn_implementation(SWAPPED)
        try:
            yield
        finally:
            model.set_attn_implementation(previous)

    def decode(self, model, prompts, eos_token_ids, seeds):
        assert model.config._attn_implementation == SWAPPED
        SwapAttentionDecoder.cudnn_seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if self.cfg.fail:
            raise RuntimeError("decoder failed mid-run")
        return super().decode(model, prompts, eos_token_ids, seeds)


@dataclass
class GuidedConfig(ARDecoderConfig):
    name: str = "guided_test"
    guide: Optional[str] = None


class GuidedDecoder(ARDecoder):
    """AR greedy of the auxiliary ``guide`` model instead of the evaluated one."""

    name = "guided_test"
    auxiliary_fields = ("guide",)

    def decode(self, model, prompts, eos_token_ids, seeds):
        return super().decode(self.auxiliary["guide"], prompts, eos_token_ids, seeds)


@pytest.fixture
def test_decoders(monkeypatch):
    monkeypatch.setitem(registry._DECODERS, "swap_test", "tests.test_decoder_lifecycle:SwapAttentionDecoder:SwapConfig")
    monkeypatch.setitem(registry._DECODERS, "guided_test", "tests.test_decoder_lifecycle:GuidedDecoder:GuidedConfig")


@pytest.fixture
def setup():
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=0)
    model.set_attn_implementation("sdpa")
    return model, tok, datasets.Dataset.from_list(EVAL_ROWS)


def outputs(result):
    return [r["output_ids"] for r in result.records]


def test_prepare_installs_a_registered_attention_and_the_reference_run_sees_the_model_restored(test_decoders, setup):
    model, tok, rows = setup
    common = {"max_new_tokens": 8, "batch_size": 1}
    plain = evaluate(model, tok, rows, {"name": "ar", **common}, agreement=False)
    swapped = evaluate(model, tok, rows, {"name": "swap_test", **common}, agreement=True)
    assert outputs(swapped) != outputs(plain)  # the custom attention really ran
    assert [r["reference_ids"] for r in swapped.records] == outputs(plain)  # the AR reference ran restored
    assert model.config._attn_implementation == "sdpa"
    again = evaluate(model, tok, rows, {"name": "ar", **common}, agreement=False)
    assert outputs(again) == outputs(plain)


def test_prepare_restores_the_model_when_decoding_fails(test_decoders, setup):
    model, tok, rows = setup
    with pytest.raises(RuntimeError, match="decoder failed mid-run"):
        evaluate(model, tok, rows, {"name": "swap_test", "fail": True, "max_new_tokens": 4}, agreement=False)
    assert model.config._attn_implementation == "sdpa"


def test_decoding_runs_without_cudnn_attention_and_restores_the_setting(test_decoders, setup):
    """``evaluate`` decodes with cuDNN attention off (a cached step's shape is new at every step, and
    cuDNN plans each new shape), then restores the process's setting, also after a failure; an
    outer restriction stays."""
    model, tok, rows = setup
    SwapAttentionDecoder.cudnn_seen = []
    assert torch.backends.cuda.cudnn_sdp_enabled()
    evaluate(model, tok, rows, {"name": "swap_test", "max_new_tokens": 4, "batch_size": 2}, agreement=False)
    assert SwapAttentionDecoder.cudnn_seen == [False] * -(-len(rows) // 2)  # one decode call per batch of 2
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="decoder failed mid-run"):
        evaluate(model, tok, rows, {"name": "swap_test", "fail": True, "max_new_tokens": 4}, agreement=False)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        evaluate(model, tok, rows, {"name": "swap_test", "max_new_tokens": 4}, agreement=False)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_summarize_defaults_to_nothing():
    decoder = ARDecoder(ARDecoderConfig(), tokenizer=None)
    assert decoder.summarize([{"index": 0}]) == {}


def test_auxiliary_models_are_named_by_the_config_and_handed_over(test_decoders, setup):
    model, tok, rows = setup
    guide = tiny_model(len(tok), seed=1)
    cfg = {"name": "guided_test", "guide": "runs/some_ar_export", "max_new_tokens": 8}
    assert registry.auxiliary_checkpoints(cfg) == {"guide": "runs/some_ar_export"}
    assert registry.auxiliary_checkpoints({"name": "guided_test"}) == {}
    with pytest.raises(ConfigError, match=r"decoder\.guide"):
        evaluate(model, tok, rows, cfg, agreement=False)
    guided = evaluate(model, tok, rows, cfg, agreement=False, auxiliary={"guide": guide})
    own_guide = evaluate(guide, tok, rows, {"name": "ar", "max_new_tokens": 8}, agreement=False)
    assert outputs(guided) == outputs(own_guide)
    with pytest.raises(ConfigError, match="does not use"):
        evaluate(model, tok, rows, {"name": "ar"}, agreement=False, auxiliary={"guide": guide})


def test_attention_names_are_checked_against_the_transformers_registry():
    check_attn_implementation("sdpa", "attn_implementation")
    check_attn_implementation("auto", "attn_implementation")
    with pytest.raises(ConfigError, match="'model.attn_implementation' = 'pardec_not_registered'"):
        check_attn_implementation("pardec_not_registered", "model.attn_implementation")
    AttentionInterface.register("pardec_test_registered", reversed_keys_attention)
    check_attn_implementation("pardec_test_registered", "attn_implementation")


def test_jacobi_block_size_defaults_to_the_recorded_one():
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    prompt = tok("Question: what is 1 plus 2 ? Answer:")["input_ids"]
    decoder = JacobiDecoder(JacobiDecoderConfig(max_new_tokens=12), tok)
    with pytest.raises(ConfigError, match="decoder.block_size.*jacobi_block_size"):
        decoder.decode(model, [prompt], {0}, [0])
    CheckpointMetadata(recipe="jacobi_forcing", jacobi_block_size=5).write_to(model)
    recorded = decoder.decode(model, [prompt], {0}, [0])[0]
    explicit = JacobiDecoder(JacobiDecoderConfig(max_new_tokens=12, block_size=5),
                             tok).decode(model, [prompt], {0}, [0])[0]
    other = JacobiDecoder(JacobiDecoderConfig(max_new_tokens=12, block_size=2),
                          tok).decode(model, [prompt], {0}, [0])[0]
    assert recorded.tokens == explicit.tokens and recorded.forwards == explicit.forwards
    assert recorded.stats["blocks"] != other.stats["blocks"]


def test_metadata_record_round_trips_and_rejects_bad_values(tmp_path):
    record = CheckpointMetadata(recipe="idlm", mask_token_id=7, isd_stride=4)
    assert CheckpointMetadata.from_dict(record.to_dict(), "x") == record
    assert record.updated(isd_stride=3, jacobi_block_size=None).to_dict() == {"recipe": "idlm", "mask_token_id": 7,
                                                                             "isd_stride": 3}
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    record.write_to(model)
    model.save_pretrained(tmp_path)
    assert CheckpointMetadata.read(tmp_path) == record
    with pytest.raises(CheckpointError, match=r"unknown key\(s\) \['pardec.isd_strde'\]"):
        CheckpointMetadata.from_dict({"isd_strde": 4}, "config.json of x")
    with pytest.raises(CheckpointError, match=r"config.json of x: 'pardec.isd_stride' = 1; expected an integer >= 2"):
        CheckpointMetadata.from_dict({"isd_stride": 1}, "config.json of x")
    with pytest.raises(CheckpointError, match="'pardec.attention' = 'sideways'"):
        CheckpointMetadata.from_dict({"attention": "sideways"}, "x")
    with pytest.raises(CheckpointError, match="no attention_block_size"):
        CheckpointMetadata.from_dict({"attention": "block"}, "x")
    with pytest.raises(CheckpointError, match="no config.json"):
        CheckpointMetadata.read(tmp_path / "missing")


def _mdm_export(tok, attention: str = "bidirectional"):
    """A tiny model recording what a recipe=mdm export records (bidirectional attention, shift, <|mask|>)."""
    model = tiny_model(len(tok))
    CheckpointMetadata(recipe="mdm", attention=attention, logit_shift=True,
                       attention_block_size=2 if attention == "block" else None,
                       mask_token_id=tok.convert_tokens_to_ids("<|mask|>")).write_to(model)
    return model


@pytest.mark.parametrize("name", ["ar", "jacobi", "multiblock", "isd", "refusion"])
def test_causal_decoder_on_an_mdm_export_is_refused_before_decoding(name, monkeypatch):
    """Issue 40: AR greedy and Jacobi ran on a bidirectional MDM export and reported 0% accuracy.
    Every decoder of causal checkpoints is refused before anything is decoded, with both kinds named."""
    import pardec.inference.evaluate as evaluate_module

    tok = tiny_tokenizer(("<|mask|>",))
    decoded = []
    monkeypatch.setattr(evaluate_module, "run_decoder", lambda *args, **kwargs: decoded.append(args))
    with pytest.raises(CheckpointError,
                       match=rf"decoder '{name}' decodes checkpoints of kind .*ar.* but config.json of "
                             r".* is a checkpoint of kind mdm-bidirectional \(pardec.recipe='mdm', "
                             r"attention='bidirectional'.*decode it with cover, mdm_guided"):
        evaluate(_mdm_export(tok), tok, datasets.Dataset.from_list(EVAL_ROWS[:2]), {"name": name, "max_new_tokens": 4})
    assert decoded == []


@pytest.mark.parametrize("name", ["mdm_lowconf", "cover", "isd"])
def test_decoder_on_a_plain_ar_checkpoint_is_refused_naming_the_kinds(name):
    tok = tiny_tokenizer()
    with pytest.raises(CheckpointError, match=rf"decoder '{name}' decodes checkpoints of kind .* is a checkpoint of "
                                              r"kind ar \(pardec.recipe=None.*decode it with ar, jacobi, multiblock$"):
        evaluate(tiny_model(len(tok)), tok, datasets.Dataset.from_list(EVAL_ROWS[:1]), {"name": name})


def test_every_decoder_declares_the_checkpoint_kinds_it_decodes():
    from pardec.common.metadata import CHECKPOINT_KINDS

    for name in registry._DECODERS:
        kinds = registry._resolve(name)[0].checkpoint_kinds
        assert kinds and set(kinds) <= set(CHECKPOINT_KINDS), name
    tok = tiny_tokenizer(("<|mask|>",))
    for attention in ("bidirectional", "block"):  # and an MDM export is accepted by the MDM decoders
        registry.check_checkpoint_kind("mdm_lowconf", CheckpointMetadata.of_model(_mdm_export(tok, attention)), "x")
