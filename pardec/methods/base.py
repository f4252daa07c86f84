"""The contract between a training method (AR, I-DLM, Jacobi Forcing, ...) and the trainer.

The trainer owns the loop (DeepSpeed engine, optimiser, schedule, checkpoints, logging); a method
owns everything that is paper-specific:

1. ``prepare_model``: e.g. add ``<|mask|>`` or wrap a gated LoRA, before DeepSpeed sees the model;
2. ``build_train_dataset``: turn the tokenised prompt/response dataset into training examples
   (identity for AR; ``[x_t | x_0]`` for I-DLM; trajectories for Jacobi Forcing, collected with
   the current model, which is why the model is passed);
3. ``collate``: pack examples into a batch dict with ``input_ids``, ``position_ids`` (always
   explicit), method-specific label tensors and an ``attention`` :class:`pardec.masks.core.AttentionSpec`;
4. ``loss``: one forward of the model on that batch, returning the scalar to backpropagate and a
   dict of floats to log. The loss is a per-micro-batch mean; DeepSpeed divides by the gradient
   accumulation steps itself, so a method must not divide again.

Multi-stage recipes (stride curricula, progressive distillation rounds) are a list of stages in
the recipe config; ``stage_overrides`` are merged into the method config before each stage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pardec.common.config_fields import check_config
from pardec.masks.core import AttentionSpec, materialize


class Method(ABC):
    name: str = "base"
    # True when the method's mask is not a per-segment causal mask (flex_attention on GPU).
    needs_custom_mask: bool = False

    def __init__(self, cfg: Any, tokenizer):
        check_config(cfg, "recipe")  # every declared range and choice of the recipe's config
        self.cfg = cfg
        self.tokenizer = tokenizer

    def prepare_model(self, model):
        """Modify the model before it is wrapped by DeepSpeed. Default: unchanged."""
        return model

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        """Examples the collator consumes. Default: the tokenised dataset as is."""
        return tokenized

    def max_positions(self, data_cfg) -> tuple[int, str]:
        """The most positions one training sample can use (its largest position id + 1) and the
        config keys that set it; the trainer refuses at start a base model with fewer
        (``pardec.models.loading.check_max_positions``). Positions, not slots: packing restarts positions
        at 0 per sample and I-DLM's ``[x_t | x_0]`` repeats positions 0..L-1, so the default is
        ``data.max_length`` whatever ``data.pack_length`` is."""
        return data_cfg.max_length, f"data.max_length={data_cfg.max_length}"

    @property
    def trains_on_responses(self) -> bool:
        """True when the loss targets are the responses' tokens: a training set whose every
        response is empty (EOS-only targets) is then refused by ``tokenize_dataset``."""
        return True

    def begin_step(self, step: int) -> None:
        """Called by the trainer before collating the micro-batches of optimiser step ``step``
        (0-based). Methods whose batches are random (ReFusion's slot masking) seed them from it,
        so a resumed run rebuilds exactly the same batches. Default: nothing."""

    @abstractmethod
    def collate(self, examples: list[dict]) -> dict[str, Any]:
        """Batch dict: ``input_ids``/``position_ids`` ``[b, s]``, labels, ``attention`` spec."""

    @abstractmethod
    def loss(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss (per-micro-batch mean) and floats to log."""

    def export_metadata(self) -> dict[str, Any]:
        """Fields of :class:`pardec.common.metadata.CheckpointMetadata` this method records in its export
        (the trainer merges them into the model's record and validates them); decoders read them."""
        return {"recipe": self.name}


def forward_logits(model, batch: dict[str, Any]) -> torch.Tensor:
    """Run ``model`` on a collated batch, materialising the mask for the model's attention backend."""
    spec: AttentionSpec | None = batch.get("attention")
    attn_impl = _attn_implementation(model)
    dtype = next(p for p in model.parameters()).dtype
    mask = materialize(spec, attn_impl, dtype)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask, use_cache=False)
    return out.logits


def _attn_implementation(model) -> str:
    inner = getattr(model, "module", model)
    return getattr(inner.config, "_attn_implementation", None) or "sdpa"


def move_batch(batch: dict[str, Any], device) -> dict[str, Any]:
    moved = {}
    for k, v in batch.items():
        if isinstance(v, (torch.Tensor, AttentionSpec)):
            moved[k] = v.to(device)
        else:
            moved[k] = v
    return moved
