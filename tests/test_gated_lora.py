"""Gated LoRA for R-ISD: exact base equality at gate 0, per-token gating, gradient routing on an
I-DLM batch, gradient checkpointing, refusals, adapter round trip, and a short ``idlm_lora`` run
through the real trainer with the base bit-identical afterwards.

References: arXiv:2604.11035 (I-DLM), §3.2 and App. G.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pardec.common.constants import IGNORE_INDEX, MASK_TOKEN
from pardec.common.errors import ConfigError
from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.losses.idlm import idlm_loss
from pardec.methods.base import forward_logits
from pardec.methods.idlm_lora import IDLMLoraMethod
from pardec.models.gated_lora import (
    ADAPTER_SUBDIR,
    GATED_LORA_FILE,
    load_gated_lora,
    load_gated_lora_export,
    save_gated_lora,
    wrap_gated_lora,
)
from pardec.models.loading import load_model, load_tokenizer
from tests.test_idlm_batch import MASK_ID, random_samples, tiny_model
from tests.train_utils import FAST, compose_train, logged_metrics, run_in_process

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gated(arch: str = "qwen3", seed: int = 0, lora_alpha: float = 8, **lora_kwargs):
    """(gated PeftModel, untouched copy of its base); LoRA A and B both random (init_lora_weights=False),
    so an ungated residual would change every output."""
    base = tiny_model(arch, seed=seed)
    reference = copy.deepcopy(base)
    torch.manual_seed(seed + 100)
    config = LoraConfig(r=4, lora_alpha=lora_alpha, target_modules=TARGETS, init_lora_weights=False,
                        task_type="CAUSAL_LM", **lora_kwargs)
    return wrap_gated_lora(base, config, MASK_ID), reference


def idlm_batch(spec, seed: int, block: int = 2, pack: int = 32):
    return build_idlm_batch(random_samples(spec, seed=seed), mask_token_id=MASK_ID, block_size=block, pack_length=pack)


def lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_without_masks_outputs_equal_the_base_bitwise(arch):
    model, base = gated(arch)
    ids = torch.randint(1, MASK_ID, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
        masked = torch.full_like(ids, MASK_ID)
        assert not torch.allclose(model(input_ids=masked).logits, base(input_ids=masked).logits)  # LoRA is live


def test_gate_is_set_when_the_causal_lm_runs_as_forward():
    """PEFT before 0.21 runs the wrapped causal LM as ``model.forward(...)``, skipping that module's hooks;
    the gate must still follow this call's input_ids, not a stale gate from the call before it."""
    model, base = gated()
    ids = torch.randint(1, MASK_ID, (2, 12))
    masked = ids.clone()
    masked[:, 5:] = MASK_ID
    with torch.no_grad():
        model(input_ids=ids)  # leaves an all-zero gate behind
        direct = model.get_base_model().forward(input_ids=masked).logits
        assert torch.equal(direct, model(input_ids=masked).logits)
        assert not torch.allclose(direct[:, 5:], base(input_ids=masked).logits[:, 5:])  # the residual applied
        assert torch.equal(model.get_base_model().forward(input_ids=ids).logits, base(input_ids=ids).logits)


def test_residual_only_on_mask_inputs_per_projection():
    """Plain causal forward: every gated projection adds B A x exactly at the <|mask|> input rows."""
    model, _ = gated()
    ids = torch.randint(1, MASK_ID, (2, 12))
    ids[0, [3, 7, 8]] = MASK_ID
    ids[1, 11] = MASK_ID
    deltas = []

    def record(module, inputs, output):
        deltas.append((output - module.base_layer(inputs[0])).abs().amax(-1))  # [b, s]

    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == 2 * len(TARGETS)
    handles = [m.register_forward_hook(record) for m in layers]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for delta in deltas:
        assert torch.equal(delta != 0, ids == MASK_ID)


def test_idlm_batch_changes_only_mask_slots():
    """Under the I-DLM mask, clean queries never see masks: every non-mask slot (x_0, the clean
    prompt in x_t, padding) is bitwise the base; every mask slot differs."""
    model, base = gated()
    batch = idlm_batch([(7, 3), (5, 1), (6, 2)], seed=1, pack=40)
    with torch.no_grad():
        diff = (forward_logits(model, batch) - forward_logits(base, batch)).abs().amax(-1)  # [r, s]
    is_mask = batch["input_ids"] == MASK_ID
    assert is_mask.any() and (~is_mask).any()
    assert torch.equal(diff != 0, is_mask)


def test_gradients_reach_lora_only_through_mask_positions():
    model, _ = gated()
    params = lora_params(model)
    assert params and all(".lora_A." in n or ".lora_B." in n for n in params)
    batch = idlm_batch([(7, 3), (5, 1), (6, 2)], seed=2, pack=40)
    logits = forward_logits(model, batch)
    clean_grads = torch.autograd.grad(ce(logits, batch["labels_clean_stream"]), list(params.values()),
                                      retain_graph=True)
    mask_grads = torch.autograd.grad(ce(logits, batch["labels_mask_stream"]), list(params.values()))
    for name, g_clean, g_mask in zip(params, clean_grads, mask_grads):
        assert torch.count_nonzero(g_clean) == 0, name
        assert torch.count_nonzero(g_mask) > 0, name


def test_last_prompt_slot_option_changes_no_lora_gradient():
    """The last prompt token's x_t slot is a clean input (gate 0): supervising it adds a constant to
    idlm_lora's L_mask (same denominator, the answer count) and nothing to the LoRA gradients."""
    model, _ = gated(seed=6)
    params = lora_params(model)
    results = {}
    for supervise in (False, True):
        batch = build_idlm_batch(random_samples([(7, 3), (5, 1), (6, 2)], seed=2), mask_token_id=MASK_ID,
                                 block_size=2, pack_length=40, supervise_last_prompt_slot=supervise)
        loss, logs = idlm_loss(forward_logits(model, batch), batch["labels_mask_stream"],
                               batch["labels_clean_stream"], 0.0)
        results[supervise] = (logs["l_mask"], torch.autograd.grad(loss, list(params.values())))
    (off_loss, off_grads), (on_loss, on_grads) = results[False], results[True]
    assert on_loss > off_loss
    for name, g_off, g_on in zip(params, off_grads, on_grads):
        assert torch.count_nonzero(g_off) > 0, name
        torch.testing.assert_close(g_on, g_off, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_same_loss_and_grads_with_gate_replay():
    """Non-reentrant checkpointing re-runs layers in backward; a second forward (other gate, same
    shape) between forward and backward must not leak into the first one's gradients."""
    first = idlm_batch([(7, 3), (5, 1)], seed=3, pack=24)
    second = idlm_batch([(5, 4), (7, 1)], seed=4, pack=24)
    assert not torch.equal(first["input_ids"] == MASK_ID, second["input_ids"] == MASK_ID)
    results = []
    for checkpointing in (False, True):
        model, _ = gated(seed=5)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        loss = ce(forward_logits(model, first), first["labels_mask_stream"])
        ce(forward_logits(model, second), second["labels_mask_stream"])  # sets another gate, never backpropagated
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lora_params(model).items()}))
    (loss_off, grads_off), (loss_on, grads_on) = results
    assert torch.equal(loss_off, loss_on)
    assert grads_off.keys() == grads_on.keys()
    for name in grads_off:
        assert torch.count_nonzero(grads_off[name]) > 0, name
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=0, atol=0, msg=name)


def test_reentrant_checkpointing_is_refused():
    model, _ = gated()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    with pytest.raises(ValueError, match="use_reentrant': False"):
        model(input_ids=torch.randint(1, MASK_ID, (1, 6)))


def test_merging_is_refused():
    model, base = gated()
    layer = next(m for m in model.modules() if isinstance(m, LoraLinear))
    for attempt in (model.merge_and_unload, model.merge_adapter, layer.merge):
        with pytest.raises(RuntimeError, match="cannot be merged"):
            attempt()
    masked = torch.full((1, 8), MASK_ID)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=masked).logits, base(input_ids=masked).logits)
        assert torch.equal(model.unload()(input_ids=masked).logits, base(input_ids=masked).logits)  # nothing merged


@pytest.mark.parametrize("kwargs, key", [
    ({"use_dora": True}, "use_dora"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"trainable_token_indices": [MASK_ID]}, "trainable_token_indices"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
])
def test_non_plain_lora_is_refused(kwargs, key):
    base = tiny_model("qwen3")
    config = LoraConfig(r=4, target_modules=TARGETS, task_type="CAUSAL_LM", **kwargs)
    with pytest.raises(ConfigError, match=key):
        wrap_gated_lora(base, config, MASK_ID)


def test_non_linear_targets_and_missing_input_ids_are_refused():
    with pytest.raises(ConfigError, match="lora.Linear"):
        wrap_gated_lora(tiny_model("qwen3"), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), MASK_ID)
    model, _ = gated()
    with pytest.raises(ValueError, match="needs input_ids"):
        model(inputs_embeds=torch.randn(1, 4, 32))


def test_adapter_round_trip(tmp_path):
    model, _ = gated(seed=7)
    save_gated_lora(model, tmp_path)
    assert {"adapter_model.safetensors", "adapter_config.json", GATED_LORA_FILE} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / GATED_LORA_FILE).read_text())["mask_token_id"] == MASK_ID
    ids = torch.randint(1, MASK_ID, (2, 12))
    ids[:, 8:] = MASK_ID
    loaded = load_gated_lora(tiny_model("qwen3", seed=7), tmp_path)  # mask id read from gated_lora.json
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        clean = ids.clone()
        clean[:, 8:] = 1
        assert torch.equal(loaded(input_ids=clean).logits, tiny_model("qwen3", seed=7)(input_ids=clean).logits)
    with pytest.raises(ConfigError, match="records mask id"):
        load_gated_lora(tiny_model("qwen3", seed=7), tmp_path, mask_token_id=MASK_ID - 1)


@pytest.mark.parametrize("lora_alpha", [4, 8])  # scale 1 and 2
def test_adapter_loaded_for_decoding_runs_the_lean_forward_bitwise_as_peft(tmp_path, lora_alpha):
    """A loaded adapter's layers skip PEFT's forward (no LoRA-A module call, so its hook never runs)
    and give PEFT's output bit for bit, a deep copy included; in training mode and with the adapter
    disabled PEFT's forward runs."""
    model, base = gated(seed=8, lora_alpha=lora_alpha, lora_dropout=0.5)
    save_gated_lora(model, tmp_path)
    loaded = load_gated_lora(tiny_model("qwen3", seed=8), tmp_path)
    calls = []
    for module in loaded.modules():
        if isinstance(module, LoraLinear):
            module.lora_A["default"].register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(1, MASK_ID, (2, 12))
    ids[0, 4:] = MASK_ID
    ids[1, [2, 9]] = MASK_ID
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        assert not calls
        with loaded.disable_adapter():
            assert torch.equal(loaded(input_ids=ids).logits, base(input_ids=ids).logits)
        twin = copy.deepcopy(loaded)  # its layers run on its own weights, not on the original's
        for module in twin.modules():
            if isinstance(module, LoraLinear):
                module.lora_B["default"].weight.zero_()
        assert torch.equal(twin(input_ids=ids).logits, base(input_ids=ids).logits)
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    loaded.train()
    torch.manual_seed(0)
    trained = loaded(input_ids=ids).logits  # PEFT's forward, with its dropout
    assert len(calls) == 2 * len(TARGETS)
    model.train()
    torch.manual_seed(0)
    assert torch.equal(trained, model(input_ids=ids).logits)


def _plain_base_state(module) -> dict[str, torch.Tensor]:
    """The base tensors of the trained module, named as in a plain HF checkpoint."""
    state = module.peft_model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in state.items()
            if ".lora_A." not in k and ".lora_B." not in k}


def test_idlm_lora_training_run_keeps_the_base_bit_identical(tmp_path, monkeypatch):
    # An AR base export (no <|mask|>) for model.path, built from the tiny Qwen3 config (tied embeddings).
    cfg = compose_train(FAST + ["recipe=ar"])
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    base_dir = tmp_path / "base"
    load_model(cfg.model, tokenizer, torch.float32, "sdpa").save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    original = load_file(str(base_dir / "model.safetensors"))

    seen = {}
    prepare = IDLMLoraMethod.prepare_model

    def spy(self, model):
        module = prepare(self, model)
        seen["base"] = _plain_base_state(module)
        seen["trainable"] = [n for n, p in module.named_parameters() if p.requires_grad]
        seen["module"] = module
        return module

    monkeypatch.setattr(IDLMLoraMethod, "prepare_model", spy)
    out = tmp_path / "run"
    result = run_in_process([
        f"output_dir={out}", "recipe=idlm_lora", f"model.path={base_dir}", "model.tokenizer=null", "model.config=null",
        "model.gradient_checkpointing=true", "data.pack_length=512", "trainer.max_steps=2",
        "recipe.lora_rank=8", "recipe.lora_alpha=16",
    ])
    assert result.status == "finished" and result.step == 2

    # only the gated LoRA trained; the live base (incl. the <|mask|> row) is bitwise unchanged
    assert seen["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in seen["trainable"])
    after = _plain_base_state(seen["module"])
    for name, tensor in seen["base"].items():
        assert torch.equal(after[name], tensor), name

    # export: base + <|mask|> row as a plain HF checkpoint, equal to the original base row for row
    mask_id = AutoTokenizer.from_pretrained(result.export_dir).convert_tokens_to_ids(MASK_TOKEN)
    exported = load_file(str(result.export_dir / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, seen["base"][name]), name
        if name == "model.embed_tokens.weight":
            assert mask_id == original[name].shape[0] == tensor.shape[0] - 1
            assert torch.equal(tensor[:mask_id], original[name])
        else:
            assert torch.equal(tensor, original[name]), name
    meta = json.loads((result.export_dir / "config.json").read_text())["pardec"]
    assert meta.pop("base_model")  # provenance for the model card (and "command" when run from the CLI)
    meta.pop("command", None)
    assert meta == {"recipe": "idlm_lora", "mask_token_id": mask_id, "isd_stride": 3,
                    "gated_lora_adapter": ADAPTER_SUBDIR}

    # adapter: plain PEFT files, trained (lora_B starts at 0), loads back with the gate
    adapter = load_file(str(result.export_dir / ADAPTER_SUBDIR / "adapter_model.safetensors"))
    assert any(".lora_B." in k and torch.count_nonzero(v) > 0 for k, v in adapter.items())
    model = load_gated_lora_export(result.export_dir).eval()
    plain = AutoModelForCausalLM.from_pretrained(result.export_dir).eval()
    ids = torch.tensor([[5, 9, 13, 20, 31, 7]])
    masked = torch.tensor([[5, 9, 13, mask_id, mask_id, mask_id]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert not torch.equal(model(input_ids=masked).logits, plain(input_ids=masked).logits)
    with pytest.raises(ConfigError, match="already a gated-LoRA export"):
        IDLMLoraMethod(compose_train(FAST + ["recipe=idlm_lora"]).recipe, tokenizer).prepare_model(plain)
    metrics = logged_metrics(out)
    assert len(metrics) == 2 and all(m["scale"] == 0.0 and m["l_clean"] > 0 and m["loss"] == m["l_mask"]
                                     for m in metrics)


@pytest.mark.parametrize("override, key", [
    ("recipe.alpha=0.2", "recipe.alpha"),
    ("recipe.stages=[{name: a, max_steps: 1, overrides: {stride: 2}}]", "recipe.stages"),
])
def test_idlm_lora_config_errors(override, key):
    cfg = compose_train(FAST + ["recipe=idlm_lora", override])
    with pytest.raises(ConfigError, match=key):
        IDLMLoraMethod(cfg.recipe, tokenizer=None)
