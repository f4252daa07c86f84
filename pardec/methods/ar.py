"""AR recipe: causal LM fine-tuning / pre-training on response tokens, with packing.

It trains the embedded default's base and is the baseline every parallel decoder is compared to.
Loss: token-mean next-token cross-entropy over response targets (and EOS); a target never crosses
a packed sample boundary; prompt targets are ignored unless ``recipe.train_on=all``.

References: standard causal language modelling (no paper-specific method).
"""

from __future__ import annotations

from dataclasses import dataclass

from pardec.common.config_fields import Choice
from pardec.data_pipelines.packing import PAD_SEGMENT, pack_dataset, pad_rows, single_sample_rows
from pardec.losses.causal_lm import shifted_labels
from pardec.losses.cross_entropy import token_mean_cross_entropy
from pardec.masks.core import causal_document_spec
from pardec.methods.base import Method, forward_logits
from pardec.methods.recipe_config import RecipeConfig


class TrainOn(Choice):
    """response: loss on response tokens (+EOS) only; all: every token (pre-training text)."""

    response = "response"
    all = "all"


@dataclass
class ARConfig(RecipeConfig):
    name: str = "ar"
    train_on: TrainOn = TrainOn.response


class ARMethod(Method):
    name = "ar"

    @property
    def trains_on_responses(self) -> bool:
        return self.cfg.train_on != "all"  # all: prompts are targets too (plain pre-training text)

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        train_all = self.cfg.train_on == "all"

        def add_loss_mask(row):
            p = 0 if train_all else row["prompt_len"]
            return {"loss_mask": [0] * p + [1] * (row["length"] - p)}

        with_mask = tokenized.map(add_loss_mask, desc="loss mask")
        columns = ("input_ids", "loss_mask")
        if data_cfg.packing:
            return pack_dataset(with_mask, data_cfg.pack_length or data_cfg.max_length, columns)
        return single_sample_rows(with_mask, columns)

    def collate(self, examples):
        batch = pad_rows(
            examples,
            {"input_ids": self.tokenizer.pad_token_id, "position_ids": 0, "segment_ids": PAD_SEGMENT, "loss_mask": 0},
        )
        labels = shifted_labels(batch["input_ids"], batch["segment_ids"], batch["loss_mask"].bool())  # [b, s]
        return {
            "input_ids": batch["input_ids"],
            "position_ids": batch["position_ids"],
            "labels": labels,
            "attention": causal_document_spec(batch["segment_ids"]),
        }

    def loss(self, model, batch):
        logits = forward_logits(model, batch)  # [b, s, V]
        loss, n_tokens = token_mean_cross_entropy(logits, batch["labels"])
        return loss, {"loss_ar": loss.item(), "n_target_tokens": float(n_tokens)}
