"""Plain LoRA training (``model.lora.rank``): the merged export against PEFT's own merge, a short MDM run
with every frozen tensor bit-identical in its export and the export equal to PEFT's merge of the trained
model, exact resume, a multi-stage recipe chaining merged exports, and the config refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pardec.common.constants import MASK_TOKEN
from pardec.common.errors import ConfigError
from pardec.inference.checkpoint import load_checkpoint
from pardec.methods.idlm_lora import GatedLoraTrainingModule
from pardec.models.lora import PROJECTIONS, MergedLoraModule, merged_state_dict, wrap_lora
from tests.test_idlm_batch import tiny_model
from tests.train_utils import exported_weights, logged_metrics, run_in_process, save_tiny_base


def random_lora(arch: str, seed: int = 0, r: int = 4, alpha: float = 8.0):
    """A PeftModel on a tiny model with random A and B (init_lora_weights=False), so the merge matters."""
    base = tiny_model(arch, seed=seed)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(PROJECTIONS), init_lora_weights=False,
                        task_type="CAUSAL_LM")
    return get_peft_model(base, config)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_merged_state_dict_equals_peft_merge_and_its_logits(arch, tmp_path):
    peft_model = random_lora(arch).eval()
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()  # PEFT's own merge
    merged = merged_state_dict(peft_model.state_dict(), scaling=8.0 / 4)
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)

    # the export is a plain checkpoint whose logits are the live adapter's
    MergedLoraModule(peft_model).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[3, 17, 8, 25, 40, 2, 11]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_missing_lora_b_is_named():
    state = random_lora("qwen3").state_dict()
    victim = next(k for k in state if ".lora_B." in k)
    del state[victim]
    with pytest.raises(KeyError, match=victim.replace(".", r"\.")):
        merged_state_dict(state, scaling=1.0)


def test_exports_refuse_pickle_naming_the_export(tmp_path):
    for module, name in ((MergedLoraModule(random_lora("qwen3")), "merged LoRA"),
                         (GatedLoraTrainingModule(random_lora("qwen3")), "gated LoRA")):
        with pytest.raises(ValueError, match=f"{name} exports are written as safetensors only"):
            module.save_pretrained(tmp_path, safe_serialization=False)
    assert not any(tmp_path.iterdir())


def test_wrap_lora_freezes_everything_else():
    module = wrap_lora(tiny_model("qwen3"), rank=2, alpha=None, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all((".lora_A." in n or ".lora_B." in n) and (".q_proj." in n or ".v_proj." in n)
                             for n in trainable)
    assert module.scaling == 1.0  # alpha null = rank


def test_mdm_lora_run_exports_the_merge_of_the_trained_adapter(tmp_path, monkeypatch):
    base_dir = tmp_path / "base"
    save_tiny_base(base_dir)
    original = load_file(str(base_dir / "model.safetensors"))

    import pardec.trainers.trainer as trainer

    seen = {}

    def spy(*args, **kwargs):
        seen["module"] = wrap_lora(*args, **kwargs)
        return seen["module"]

    monkeypatch.setattr(trainer, "wrap_lora", spy)
    result = run_in_process([
        f"output_dir={tmp_path / 'run'}", "recipe=mdm", "recipe.attention=block", "recipe.block_size=2",
        f"model.path={base_dir}", "model.tokenizer=null", "model.config=null", "model.gradient_checkpointing=true",
        "model.lora.rank=4", "model.lora.alpha=8", "trainer.max_steps=3",
    ])
    assert result.status == "finished"
    exported = exported_weights(result.export_dir)
    assert exported.keys() == original.keys()

    # the trained module, merged by PEFT itself, is the export, tensor for tensor
    peft_model = copy.deepcopy(seen["module"].peft_model)
    assert any(torch.count_nonzero(p) for n, p in peft_model.named_parameters() if ".lora_B." in n)  # it trained
    reference = peft_model.merge_and_unload().state_dict()
    changed = set()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)
        if name == "model.embed_tokens.weight":  # the <|mask|> row appended at its init, every other row the base's
            assert torch.equal(tensor[:original[name].shape[0]], original[name])
        elif not torch.equal(tensor, original[name]):
            changed.add(name.rsplit(".", 2)[-2])
    assert changed == set(PROJECTIONS)  # only the LoRA's layers moved; norms untouched

    # the export is an MDM checkpoint pardec decodes, with the method's record
    model, tokenizer = load_checkpoint(str(result.export_dir), device="cpu", dtype="float32")
    assert model.config.pardec["recipe"] == "mdm" and model.config.pardec["attention"] == "block"
    assert model.config.pardec["mask_token_id"] == tokenizer.convert_tokens_to_ids(MASK_TOKEN)


def test_lora_run_draws_the_batches_of_the_full_run(tmp_path):
    """The adapter's init leaves torch's random state alone: with B = 0 a LoRA MDM run's first step sees
    the same noised batch as the full fine-tuning run of the same config, so its loss is that run's."""
    mdm = ["recipe=mdm", "model=tiny_qwen3", "trainer.max_steps=1"]
    full = run_in_process([f"output_dir={tmp_path / 'full'}", *mdm])
    lora = run_in_process([f"output_dir={tmp_path / 'lora'}", *mdm, "model.lora.rank=4"])
    (a,), (b,) = (logged_metrics(r.export_dir.parent) for r in (full, lora))
    assert a["n_targets"] == b["n_targets"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)


def test_lora_resume_is_exact(tmp_path):
    lora = ["model.lora.rank=4", "trainer.max_steps=4"]
    straight = run_in_process([f"output_dir={tmp_path / 'straight'}", *lora])
    first = run_in_process([f"output_dir={tmp_path / 'resumed'}", *lora, "trainer.stop_after_steps=2"])
    assert first.status == "stopped"
    second = run_in_process([f"output_dir={tmp_path / 'resumed'}", *lora])
    a, b = exported_weights(straight.export_dir), exported_weights(second.export_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_multi_stage_lora_starts_each_stage_from_the_previous_merge(tmp_path):
    stages = "recipe.stages=[{name: a, max_steps: 2}, {name: b, max_steps: 2}]"
    result = run_in_process([f"output_dir={tmp_path}", stages, "model.lora.rank=4",
                             "model.lora.target_modules=[q_proj]"])
    first = exported_weights(tmp_path / "stages" / "00-a" / "hf")
    second = exported_weights(result.export_dir)
    moved = {n for n in first if not torch.equal(first[n], second[n])}
    assert moved and all(n.endswith("q_proj.weight") for n in moved)  # stage b trained q_proj on stage a's merge


@pytest.mark.parametrize("overrides, key", [
    (["recipe=idlm_lora", "model.lora.rank=4"], "model.lora.rank"),
    (["model.lora.rank=4", "model.lora.target_modules=[]"], "model.lora.target_modules"),
    (["model.lora.rank=0"], "model.lora.rank"),
    (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout"),
    (["+model.lora.rnak=4"], "model.lora.rnak"),
])
def test_lora_config_errors(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run_in_process([f"output_dir={tmp_path}", *overrides])
