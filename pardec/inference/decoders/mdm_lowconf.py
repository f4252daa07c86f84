"""LLaDA low-confidence remasking (the MDM baseline decoder): semi-AR blocks, fixed steps per block.

References: LLaDA, Large Language Diffusion Models, arXiv:2502.09992 (Appendix B, semi-autoregressive
remasking); FreeCache from FlashDLM arXiv:2505.21467 (``freecache=true``).

Each block takes ``steps_per_block`` steps (null = block_size: one token per step, the baseline);
step i commits k_i tokens, the block size split uniformly with the remainder going to the first
steps (LLaDA's ``get_num_transfer_tokens``). A step commits the k_i still-masked positions of the
current block with the highest confidence, confidence = softmax probability of the argmax token;
positions outside the block are never candidates (LLaDA's -inf right of the block). Greedy
(argmax tokens, no Gumbel noise). Unlike the official code, EOS gets no special treatment (its
``-inf`` line never took effect there, a chained-assignment bug), and decoding stops once every
position up to the first EOS is committed (see :mod:`pardec.inference.decoders.mdm_common`). No cache
(full recompute each step) unless ``freecache=true``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.common.config_fields import ranged
from pardec.common.errors import ConfigError
from pardec.inference.decoders.mdm_common import BlockRun, MDMDecoder, MDMDecoderConfig


@dataclass
class MDMLowConfConfig(MDMDecoderConfig):
    name: str = "mdm_lowconf"
    # Steps per block (1 <= steps <= block_size); null = block_size (one token per step).
    steps_per_block: int | None = ranged(None, ge=1)


def tokens_per_step(block_size: int, steps: int) -> list[int]:
    """LLaDA's schedule: ``block_size`` tokens over ``steps`` steps, the remainder to the first ones."""
    base, remainder = divmod(block_size, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def confidence(logits: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(confidence [B], argmax tokens [B])``; confidence -inf where the position is not masked."""
    probs = torch.softmax(logits.float(), dim=-1)  # [B, V]
    conf, tokens = probs.max(dim=-1)  # [B], [B]
    return conf.masked_fill(~masked, float("-inf")), tokens


class MDMLowConfDecoder(MDMDecoder):
    name = "mdm_lowconf"

    def __init__(self, cfg: MDMLowConfConfig, tokenizer):
        super().__init__(cfg, tokenizer)

    def select(self, logits: torch.Tensor, masked: torch.Tensor, step: int, run: BlockRun) -> dict[int, int]:
        steps = self.cfg.steps_per_block or run.block
        if steps > run.block:
            raise ConfigError(
                f"config key 'decoder.steps_per_block' = {steps} > the block size {run.block}: "
                "a step would commit nothing"
            )
        schedule = tokens_per_step(run.block, steps)
        k = min(schedule[step] if step < steps else 1, int(masked.sum()))
        conf, tokens = confidence(logits, masked)
        chosen = torch.topk(conf, k).indices.tolist()
        return {i: int(tokens[i]) for i in chosen}
