"""MDM recipe: Dream-style adaptation of an AR base into a masked-diffusion LM
(docs/methods/mdm.md#training).

Each micro-batch (``micro_batch_size`` samples, packed into rows of ``data.pack_length`` tokens):
every answer token is masked with probability t ~ U(eps, 1) (one t per sample), the model sees the
noisy sequence with bidirectional attention inside each sample (or block-causal, SDAR-style, with
``recipe.attention=block``), and position i predicts token i + 1 (the AR logit shift is kept, so
the base's head starts out useful). Loss: ``pardec.losses.mdm`` with weights 1/t (``linear``) or CART,
normalised per batch (default) or per sample; optional EOS padding of answers to a fixed length
(``pad_answer_to``).

The mask is always passed explicitly (``AttentionSpec`` -> dense float mask on CPU, BlockMask on
GPU) and the attention modules' ``is_causal`` flags are switched off too, so no path silently stays
causal. The export records ``attention``, ``attention_block_size``, ``logit_shift`` and the
``<|mask|>`` id for the decoders (``pardec.inference.decoders.mdm_*``).

Decision (docs/methods/mdm.md#clean-context): block-causal training on the single noisy stream noises the answer blocks
to the left of a block too, while semi-AR decoding sees them clean. ``recipe.clean_context=true``
trains SDAR / BD3-LM style on ``[x_0 | x_t]`` instead (``pardec.data_pipelines.mdm_batch``): every block
learns from the clean blocks before it, at the cost of the answer's tokens twice per sample. The
recipe default keeps the single stream (the plain recipe's); ``experiment=mdm_default`` chooses on val.

References: LLaDA arXiv:2502.09992; Dream 7B arXiv:2508.15487 (AR initialisation, logit shift,
CART); FlashDLM arXiv:2505.21467 (the decoders it serves).
"""

from __future__ import annotations

from dataclasses import dataclass

from pardec.common.config_fields import ranged
from pardec.common.errors import ConfigError, DataError
from pardec.data_pipelines.mdm_batch import Weighting, build_mdm_batch
from pardec.data_pipelines.packing import PadTo
from pardec.losses.mdm import Normalization, mdm_loss
from pardec.masks.mdm import BLOCK, MDMAttention
from pardec.methods.base import Method, forward_logits
from pardec.methods.recipe_config import RecipeConfig
from pardec.models.bidirectional import set_is_causal
from pardec.models.loading import add_mask_token


@dataclass
class MDMConfig(RecipeConfig):
    name: str = "mdm"
    # bidirectional (inside each sample) | block (block-causal, blocks of block_size answer tokens)
    attention: MDMAttention = MDMAttention.bidirectional
    block_size: int = ranged(32, ge=1)
    # t ~ U(eps, 1)
    eps: float = ranged(1.0e-3, gt=0, lt=1)
    # linear (weight 1/t) | cart (Dream's context-adaptive weight, geometric p = cart_p)
    weighting: Weighting = Weighting.linear
    cart_p: float = ranged(0.3, gt=0, le=1)
    # batch (sum / answer tokens of the micro-batch; dllm) | sample (per-sample mean, then / B; LLaDA)
    normalization: Normalization = Normalization.batch
    # Pad every answer with EOS to exactly this many tokens (and train on them); null = off.
    pad_answer_to: int | None = ranged(None, ge=1)
    # Probability that a sample is also masked from a random cut to its end (pardec.data_pipelines.mdm_batch).
    suffix_mask_prob: float = ranged(0.0, ge=0, le=1)
    # Block attention only: train on [x_0 | x_t] so each block sees clean blocks before it (SDAR).
    clean_context: bool = False


class MDMMethod(Method):
    name = "mdm"
    needs_custom_mask = True

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        if cfg.clean_context and cfg.attention != BLOCK:
            raise ConfigError(f"config key 'recipe.clean_context' = true needs recipe.attention={BLOCK}, "
                              f"got {cfg.attention!r}")
        self.mask_token_id: int | None = None
        self.pack_length: int | None = None
        self.pad_to = PadTo.pack_length

    def prepare_model(self, model):
        self.mask_token_id = add_mask_token(model, self.tokenizer)
        set_is_causal(model, False)
        return model

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        self.pack_length = data_cfg.pack_length or data_cfg.max_length
        self.pad_to = data_cfg.pad_to
        prompts, lengths = tokenized["prompt_len"], tokenized["length"]
        if self.cfg.pad_answer_to is not None:
            lengths = [p + self.cfg.pad_answer_to for p in prompts]
        if self.cfg.clean_context:  # [x_0 | x_t]: the answer twice
            lengths = [2 * n - p for n, p in zip(lengths, prompts)]
        longest = max(lengths)
        if longest > self.pack_length:
            raise DataError(
                f"an MDM sample of {longest} tokens (after answer padding"
                f"{', both streams of recipe.clean_context' if self.cfg.clean_context else ''}) > "
                f"data.pack_length={self.pack_length}; raise data.pack_length"
            )
        return tokenized

    def collate(self, examples):
        return build_mdm_batch(
            examples,
            mask_token_id=self.mask_token_id,
            pack_length=self.pack_length,
            pad_to=self.pad_to,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            attention=self.cfg.attention,
            block_size=self.cfg.block_size,
            eps=self.cfg.eps,
            weighting=self.cfg.weighting,
            cart_p=self.cfg.cart_p,
            pad_answer_to=self.cfg.pad_answer_to,
            suffix_mask_prob=self.cfg.suffix_mask_prob,
            clean_context=self.cfg.clean_context,
        )

    def loss(self, model, batch):
        logits = forward_logits(model, batch)  # [r, s, V]
        loss, logs = mdm_loss(logits, batch["labels"], batch["weights"], batch["sample_ids"], batch["n_answer"],
                              self.cfg.normalization)
        return loss, {"loss": loss.item(), **logs}

    def export_metadata(self):
        return {
            "recipe": self.name,
            "mask_token_id": self.mask_token_id,
            "attention": self.cfg.attention,
            "attention_block_size": self.cfg.block_size if self.cfg.attention == BLOCK else None,
            "logit_shift": True,
        }
