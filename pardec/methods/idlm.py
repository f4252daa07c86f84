"""I-DLM recipe: all-masked ``[x_t | x_0]`` causal training with logit shift and a balanced loss.

The stride-N ISD decoder is trained with x_t blocks of size b = N - 1 (docs/methods/idlm.md#training-input):
``recipe.stride`` sets N and the block size is derived. The stride curriculum N=2 -> 3 (fixed alpha = 0.2) -> 4
(auto-balanced) is the stage list of ``pardec/recipes/recipe/idlm.yaml``; each stage starts from the
previous stage's export.

L_mask supervises the ``<|mask|>`` x_t slots; ``recipe.supervise_last_prompt_slot=true`` also
supervises the last prompt token's (clean) x_t slot (off by default, docs/methods/idlm.md#loss; the
decision is written in :mod:`pardec.data_pipelines.idlm_batch`).

``micro_batch_size`` counts *samples* here: each micro-batch's samples are packed at collate time
into rows of ``data.pack_length`` slots, each sample taking 2L slots.

References: I-DLM, Introspective Diffusion Language Models, arXiv:2604.11035.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pardec.common.config_fields import ranged
from pardec.common.errors import DataError
from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.data_pipelines.packing import PadTo
from pardec.losses.idlm import idlm_loss
from pardec.methods.base import Method, forward_logits
from pardec.methods.recipe_config import RecipeConfig
from pardec.models.loading import add_mask_token


@dataclass
class IDLMConfig(RecipeConfig):
    name: str = "idlm"
    # ISD stride N: one exact token + N-1 drafts per step; trains x_t blocks of N-1 tokens.
    stride: int = ranged(4, ge=2)
    # Fixed weight alpha of L_clean, or null for auto-balance s = L_mask / L_clean (detached).
    alpha: Optional[float] = ranged(None, ge=0)
    # Also make the last prompt token's x_t slot (clean, equal to the causal anchor) an L_mask target.
    # Off = docs/methods/idlm.md#loss and the official code (L_mask on <|mask|> slots only); see
    # pardec.data_pipelines.idlm_batch.
    supervise_last_prompt_slot: bool = False


class IDLMMethod(Method):
    name = "idlm"
    needs_custom_mask = True

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        self.mask_token_id: int | None = None
        self.pack_length: int | None = None
        self.pad_to = PadTo.pack_length

    @property
    def block_size(self) -> int:
        return self.cfg.stride - 1

    def prepare_model(self, model):
        self.mask_token_id = add_mask_token(model, self.tokenizer)
        return model

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        self.pack_length = data_cfg.pack_length or 2 * data_cfg.max_length
        self.pad_to = data_cfg.pad_to
        longest = max(tokenized["length"])
        if 2 * longest > self.pack_length:
            raise DataError(
                f"an I-DLM sample of {longest} tokens needs {2 * longest} slots ([x_t | x_0]) > "
                f"data.pack_length={self.pack_length}; raise data.pack_length to at least 2 * data.max_length"
            )
        return tokenized

    def collate(self, examples):
        return build_idlm_batch(
            examples,
            mask_token_id=self.mask_token_id,
            block_size=self.block_size,
            pack_length=self.pack_length,
            pad_to=self.pad_to,
            pad_token_id=self.tokenizer.pad_token_id,
            supervise_last_prompt_slot=self.cfg.supervise_last_prompt_slot,
        )

    def loss(self, model, batch):
        logits = forward_logits(model, batch)  # [r, 2l, V]
        scale = "auto" if self.cfg.alpha is None else float(self.cfg.alpha)
        total, logs = idlm_loss(logits, batch["labels_mask_stream"], batch["labels_clean_stream"], scale)
        return total, {"loss": total.item(), **{k: float(v) for k, v in logs.items()}}

    def export_metadata(self):
        return {"recipe": self.name, "mask_token_id": self.mask_token_id, "isd_stride": self.cfg.stride}
