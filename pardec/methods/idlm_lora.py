"""I-DLM gated-LoRA recipe for lossless R-ISD: frozen base, LoRA on ``<|mask|>`` inputs only.

Same data, batches and attention mask as :mod:`pardec.methods.idlm` (``[x_t | x_0]``, x_t blocks of
N - 1 for stride N); the difference is what trains (docs/methods/idlm.md#r-isd-with-gated-lora):

* the base model is frozen, *all* of it, including the new ``<|mask|>`` embedding row. Decision:
  the row keeps the mean-resizing init of :func:`pardec.models.loading.add_mask_token` and is not trained
  (no ``trainable_token_indices``). It is the only new base tensor; freezing it keeps the exported
  base bit-identical to the base the run started from (plus that row), and nothing is lost: the
  mask row is a constant input, and the gated LoRA of the first layer's projections can map it to
  whatever the drafts need. (With tied embeddings, a trained row would also move the lm_head row,
  i.e. the clean stream's logit of ``<|mask|>``.)
* a gated LoRA (:mod:`pardec.models.gated_lora`, PEFT ``lora.Linear`` with a per-token gate) on
  ``target_modules`` is the only trainable part. Clean queries never attend to ``<|mask|>``
  positions, so L_clean has no gradient w.r.t. the LoRA: the recipe trains on L_mask alone, which
  is exactly the inherited I-DLM loss with a fixed ``alpha`` = 0 (``recipe.alpha`` must stay 0);
  L_clean (the base's own AR loss on the answers, constant up to the data) is still logged.
  ``recipe.supervise_last_prompt_slot`` (inherited) changes no gradient here: that x_t slot is a
  clean input (gate 0), so it only adds a constant to the logged L_mask (same denominator).

Defaults follow the paper's lossless configuration (Table 7: stride N = 3, LoRA r = 128; App. H:
lr 2e-4 on the same data). ``lora_alpha`` is not given in the paper; alpha = r (scale 1) here.

Export (``pardec/trainers/export.py`` calls ``save_pretrained`` of the trained module): the module the
trainer sees is :class:`GatedLoraTrainingModule`, whose ``save_pretrained`` writes the layout of
:func:`pardec.models.gated_lora.save_base_and_adapter`: the frozen base with ``<|mask|>`` as a plain HF
checkpoint (its ``CheckpointMetadata``: recipe, mask_token_id, isd_stride, gated_lora_adapter) and a plain
PEFT adapter in ``adapter/``; :func:`pardec.models.gated_lora.load_gated_lora_export` loads both.

References: I-DLM, Introspective Diffusion Language Models, arXiv:2604.11035, §3.2, App. G and H.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import torch
from peft import LoraConfig

from pardec.common.config_fields import ranged
from pardec.common.errors import ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.methods.idlm import IDLMConfig, IDLMMethod
from pardec.models.gated_lora import save_base_and_adapter, wrap_gated_lora
from pardec.models.lora import PROJECTIONS, PeftTrainingModule


@dataclass
class IDLMLoraConfig(IDLMConfig):
    name: str = "idlm_lora"
    stride: int = ranged(3, ge=2)
    # Weight of L_clean: fixed at 0 (L_clean has no gradient w.r.t. a gated LoRA; it is logged only).
    alpha: float = ranged(0.0, ge=0)
    lora_rank: int = ranged(128, ge=1)
    lora_alpha: float = ranged(128.0, gt=0)
    lora_dropout: float = ranged(0.0, ge=0, lt=1)
    # Linear layers that get the gated LoRA (PEFT target_modules: name suffixes).
    target_modules: List[str] = field(default_factory=lambda: list(PROJECTIONS))


class GatedLoraTrainingModule(PeftTrainingModule):
    """R-ISD's training module: ``save_pretrained`` writes base + ``adapter/`` instead of PEFT's
    adapter-only save (the method's metadata lands in the exported ``config.json``)."""

    export_name = "gated LoRA"

    def export(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        save_base_and_adapter(self.peft_model, directory, state)


class IDLMLoraMethod(IDLMMethod):
    name = "idlm_lora"

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        if cfg.alpha != 0.0:
            raise ConfigError(
                f"config key 'recipe.alpha' = {cfg.alpha}; idlm_lora trains the gated LoRA on L_mask only "
                "(L_clean has no gradient w.r.t. it and is logged): set recipe.alpha=0.0"
            )
        if cfg.stages:
            raise ConfigError(
                "config key 'recipe.stages' must be empty for idlm_lora: a later stage would start from the "
                "previous export's base and drop its adapter"
            )

    def prepare_model(self, model):
        if CheckpointMetadata.of_model(model).gated_lora_adapter is not None:
            raise ConfigError(
                f"model.path={model.name_or_path} is already a gated-LoRA export (base + adapter/); idlm_lora trains "
                "a new adapter on a plain base: point model.path at the base (e.g. the AR export)"
            )
        model = super().prepare_model(model)  # adds <|mask|>; the base is then frozen by PEFT
        lora = LoraConfig(
            r=self.cfg.lora_rank,
            lora_alpha=self.cfg.lora_alpha,
            lora_dropout=self.cfg.lora_dropout,
            target_modules=list(self.cfg.target_modules),
            task_type="CAUSAL_LM",
        )
        return GatedLoraTrainingModule(wrap_gated_lora(model, lora, self.mask_token_id))
