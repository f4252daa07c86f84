"""Plain LoRA training for any recipe (``model.lora.rank``), exported merged as a plain HF checkpoint.

``model.lora.rank=r`` trains a PEFT LoRA (``h = W x + (alpha / r) B A x``) on ``target_modules`` of the
model the method prepared, with *every* other weight frozen, the new ``<|mask|>`` embedding row
included (it keeps the mean-resizing init of :func:`pardec.models.loading.add_mask_token`; the
first layer's LoRA can map it to what the method needs). This is the cheap conversion the papers'
full fine-tuning is compared with (docs/guide/configuration.md#lora-training): fewer trained
weights, no optimiser state for the base, and a base that can only move within the adapter's rank.

Unlike R-ISD's gated LoRA (:mod:`pardec.models.gated_lora`, applied only at ``<|mask|>`` inputs and
therefore kept separate), the residual applies at every token, so the adapter can be merged: the
export is ``W + (alpha / r) B A`` for every targeted layer, written as a plain Hugging Face checkpoint
with the base's keys and config. Every decoder, ``pardec-validate``, lm-eval and plain transformers
load it as they load a fully fine-tuned export. The merge is computed from the (gathered) state
dict the trainer hands to ``save_pretrained`` (:func:`merged_state_dict`), never on the live model,
which under ZeRO-3 holds only a partition and which training may go on using.

A multi-stage recipe (I-DLM's stride curriculum, Jacobi Forcing's rounds) starts each stage from the
previous stage's merged export, so each stage trains a fresh adapter on top of the last merge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model

# Every linear projection of a Llama/Qwen-style decoder layer: the default LoRA targets (PEFT
# target_modules, name suffixes) of model.lora and of R-ISD's gated LoRA.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
_LORA_TENSORS = (".lora_A.", ".lora_B.")
_BASE_LAYER = ".base_layer."


def base_key(peft_key: str) -> str:
    """The base model's name of a PEFT-wrapped tensor (``base_model.model.x.q_proj.base_layer.weight`` ->
    ``x.q_proj.weight``)."""
    return peft_key.removeprefix(PEFT_PREFIX).replace(_BASE_LAYER, ".")


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PeftModel's state dict without its LoRA tensors, under the base model's keys."""
    return {base_key(name): tensor for name, tensor in state.items() if not any(t in name for t in _LORA_TENSORS)}


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float,
                      adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA pair of ``adapter`` merged: for each targeted
    linear layer, ``weight = W + scaling * B @ A`` (``W`` [out, in], ``A`` [r, in], ``B`` [out, r]),
    computed in fp32 and cast back to ``W``'s dtype. Tensors shared in ``state`` (tied embeddings)
    stay shared. A ``lora_A`` without its ``lora_B`` or base weight is an error naming the layer."""
    merged = base_state_dict(state)
    suffix_a = f".lora_A.{adapter}.weight"
    for name, lora_a in state.items():
        if not name.endswith(suffix_a):
            continue
        layer = name.removesuffix(suffix_a)
        weight_key, b_key = f"{layer}{_BASE_LAYER}weight", f"{layer}.lora_B.{adapter}.weight"
        if weight_key not in state or b_key not in state:
            raise KeyError(f"LoRA layer {layer!r}: {weight_key if weight_key not in state else b_key} is missing "
                           "from the state dict")
        weight = state[weight_key]
        delta = state[b_key].float() @ lora_a.float()  # [out, r] @ [r, in] -> [out, in]
        merged[base_key(weight_key)] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged


class PeftTrainingModule(torch.nn.Module):
    """The module the trainer wraps with DeepSpeed around a PeftModel: ``forward`` calls it; ``config``
    is the base model's (the method's metadata and the attention backend are read and written there);
    ``save_pretrained`` hands the PeftModel's state dict to :meth:`export`, which writes the subclass's
    export layout (merged here, base + adapter for R-ISD's gated LoRA)."""

    export_name = "LoRA"  # names the export in the safetensors-only error

    def __init__(self, peft_model: PeftModel):
        super().__init__()
        self.peft_model = peft_model

    @property
    def config(self):
        return self.peft_model.get_base_model().config

    def forward(self, *args: Any, **kwargs: Any):
        return self.peft_model(*args, **kwargs)

    def save_pretrained(self, save_directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        safe_serialization: bool = True) -> None:
        """``state_dict``: this module's full state dict (gathered under ZeRO-3), or None for the live one."""
        if not safe_serialization:
            raise ValueError(f"{self.export_name} exports are written as safetensors only (safe_serialization=True)")
        prefix = "peft_model."
        state = self.peft_model.state_dict() if state_dict is None else {
            k.removeprefix(prefix): v for k, v in state_dict.items()}
        self.export(Path(save_directory), state)

    def export(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class MergedLoraModule(PeftTrainingModule):
    """Plain LoRA training: the export is the merged base, a plain HF checkpoint."""

    export_name = "merged LoRA"

    @property
    def scaling(self) -> float:
        lora = self.peft_model.peft_config[ADAPTER]
        return lora.lora_alpha / lora.r

    def export(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        base = self.peft_model.get_base_model()
        base.save_pretrained(str(directory), state_dict=merged_state_dict(state, self.scaling), safe_serialization=True)


def wrap_lora(model: torch.nn.Module, rank: int, alpha: float | None, dropout: float,
              target_modules: Sequence[str], seed: int = 0) -> MergedLoraModule:
    """Freeze ``model`` and add a trainable LoRA of ``rank`` (``alpha`` None = ``rank``: scale 1) on the
    linear layers whose names end with one of ``target_modules``.

    The adapter's random init (PEFT's Kaiming-uniform A; B is 0) is drawn from its own generator seeded
    with ``seed``, and torch's global random state is left as it was: a LoRA run then draws the very
    same batches and noise (masks, t) as the full fine-tuning run of the same config, and since B = 0 its
    first step's loss is that run's, so the two differ only in what trains."""
    lora = LoraConfig(r=rank, lora_alpha=float(rank if alpha is None else alpha), lora_dropout=dropout,
                      target_modules=list(target_modules), task_type="CAUSAL_LM")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora, adapter_name=ADAPTER)
    return MergedLoraModule(peft_model)
