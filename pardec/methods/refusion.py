"""ReFusion recipe: slot-permuted causal training with a hybrid ARM + MDM loss
(docs/methods/refusion.md#training).

Per micro-batch (``pardec.data_pipelines.refusion_batch``): each sample's answer (response + EOS) is cut
into slots of a size k drawn from ``recipe.slot_sizes``; some slots are masked (``masking``:
``count`` = exactly max(1, floor(tK)), the paper; ``bernoulli`` = per slot, the official code; with
probability ``suffix_mask_prob`` as many slots at the end of the answer instead); the clean slots
are permuted (or, with probability ``in_order_prob``, kept in order) and placed before the masked
ones, every token at its original position id; one forward with the causal-over-buffer mask
(``pardec.masks.refusion``, always explicit; FlexAttention on GPU, never flash-attn's position-id
packing); L = L_ARM + lambda * L_MDM (``pardec.losses.refusion``, ``mdm_norm`` = mean | llada). L_ARM's
targets stay inside a slot (the paper) unless ``ar_across_slots`` also gives a token the next slot's
first token where that slot follows it in the buffer. ``suffix_mask_prob``, ``in_order_prob`` and
``ar_across_slots`` go beyond the paper and are off by default.

Randomness: the trainer calls :meth:`begin_step` before each optimiser step; sample i of
micro-batch m of step t uses the layout seed (``recipe.seed``, t, m, dataset index), so resuming at
step t rebuilds the same buffers. ``micro_batch_size`` counts samples; they are packed at collate
time into rows of ``data.pack_length`` tokens (null = ``data.max_length``).

Export: ``pardec.recipe``, ``pardec.mask_token_id`` and ``pardec.slot_size`` (``recipe.export_slot_size``,
the slot size ``decoder=refusion`` uses by default).

References: ReFusion, arXiv:2512.13586.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from pardec.common.config_fields import ranged
from pardec.common.errors import ConfigError
from pardec.data_pipelines.packing import PadTo
from pardec.data_pipelines.refusion_batch import Masking, build_refusion_batch, layout_seed
from pardec.losses.refusion import MDMNorm, refusion_loss
from pardec.methods.base import Method, forward_logits
from pardec.methods.recipe_config import RecipeConfig
from pardec.models.loading import add_mask_token


@dataclass
class ReFusionConfig(RecipeConfig):
    name: str = "refusion"
    # Slot sizes k drawn uniformly per sample (one value = fixed k).
    slot_sizes: List[int] = ranged(default_factory=lambda: [4, 8, 16, 32], ge=1)
    # count (paper: exactly max(1, floor(t K)) slots) | bernoulli (official: per slot, p = t)
    masking: Masking = Masking.count
    # mean (paper: token mean over masked tokens) | llada (official: sum CE / p_mask / answer_len / B)
    mdm_norm: MDMNorm = MDMNorm.mean
    # Probability that a sample keeps its clean slots in position order instead of permuting them
    # (beyond the paper, which always permutes: 0). Ordered clean slots are the state the decoder
    # sees when each step completes one slot (block_size = slot size).
    in_order_prob: float = ranged(0.0, ge=0, le=1)
    # Probability that a sample's masked slots are moved to the end of its answer (same count),
    # beyond the paper (0). With in-order clean slots this is the semi-AR state the decoder plans
    # from: the first masked slot sees the answer before it and nothing after it.
    suffix_mask_prob: float = ranged(0.0, ge=0, le=1)
    # Also train the next-token target across a slot boundary where the next slot follows in the
    # buffer (prompt -> slot 0, clean slots kept in order): beyond the paper (false), whose L_ARM
    # never crosses a slot, so that slot starts keep the base's AR signal.
    ar_across_slots: bool = False
    # lambda in L = L_ARM + lambda * L_MDM.
    mdm_lambda: float = ranged(1.0, ge=0)
    # The slot size recorded in the export (decoder=refusion's default k).
    export_slot_size: int = ranged(16, ge=1)
    # Seeds the per-sample layouts together with the step, micro-batch and dataset index.
    seed: int = ranged(0, ge=0)


class ReFusionMethod(Method):
    name = "refusion"
    # The permuted buffer needs an explicit mask: FlexAttention on GPU, never flash-attn varlen.
    needs_custom_mask = True

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        if not cfg.slot_sizes:
            raise ConfigError("config key 'recipe.slot_sizes' is empty; give at least one slot size")
        self.mask_token_id: int | None = None
        self.pack_length: int | None = None
        self.pad_to = PadTo.pack_length
        self.step = 0
        self.micro = 0

    def prepare_model(self, model):
        self.mask_token_id = add_mask_token(model, self.tokenizer)
        return model

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        for key, k in (("recipe.slot_sizes", max(self.cfg.slot_sizes)),
                       ("recipe.export_slot_size", self.cfg.export_slot_size)):
            if k > data_cfg.max_length:
                raise ConfigError(
                    f"config key '{key}' has a slot size {k} larger than data.max_length={data_cfg.max_length}"
                )
        self.pack_length = data_cfg.pack_length or data_cfg.max_length
        self.pad_to = data_cfg.pad_to
        if data_cfg.max_length > self.pack_length:
            raise ConfigError(
                f"data.pack_length={self.pack_length} < data.max_length={data_cfg.max_length}: a ReFusion sample "
                "takes as many slots as tokens; raise data.pack_length"
            )
        return tokenized.add_column("index", list(range(len(tokenized))))

    def begin_step(self, step: int) -> None:
        self.step, self.micro = step, 0

    def collate(self, examples):
        seeds = [layout_seed(self.cfg.seed, self.step, self.micro, int(e["index"])) for e in examples]
        self.micro += 1
        return build_refusion_batch(
            examples,
            mask_token_id=self.mask_token_id,
            pack_length=self.pack_length,
            pad_to=self.pad_to,
            seeds=seeds,
            slot_sizes=[int(k) for k in self.cfg.slot_sizes],
            masking=self.cfg.masking,
            in_order_prob=self.cfg.in_order_prob,
            suffix_mask_prob=self.cfg.suffix_mask_prob,
            ar_across_slots=self.cfg.ar_across_slots,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def loss(self, model, batch):
        logits = forward_logits(model, batch)  # [r, s, V]
        total, logs = refusion_loss(
            logits, batch["labels_arm"], batch["labels_mdm"], mdm_lambda=self.cfg.mdm_lambda,
            mdm_norm=self.cfg.mdm_norm, mdm_sample=batch["mdm_sample"], mdm_weight=batch["mdm_weight"],
        )
        return total, {"loss": total.item(), **logs}

    def export_metadata(self):
        return {"recipe": self.name, "mask_token_id": self.mask_token_id, "slot_size": self.cfg.export_slot_size}
