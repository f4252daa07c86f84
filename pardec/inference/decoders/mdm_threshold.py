"""Fast-dLLM threshold parallel decoding: top-1 plus every position with confidence >= tau.

References: Fast-dLLM, arXiv:2505.22618 (§3.3 confidence-aware parallel decoding, §3.2 prefix KV
cache); FreeCache from FlashDLM arXiv:2505.21467 (``freecache=true``).

Each step commits, among the still-masked positions of the current block, the most confident one
and every other one whose confidence (softmax probability of the argmax) is >= ``threshold``
(tau = 0.9, block 32, length 256 in the paper). ``prefix_cache`` (default true): the block's first
step is a full forward that refreshes the KV cache of everything left of the block, and its other
steps recompute only ``[last committed token, block, suffix]`` (see
:mod:`pardec.inference.decoders.mdm_common` for why the last committed token is re-fed instead of
force-committing the block's first token at the refresh, as the official Dream variant does).
``freecache=true`` replaces the prefix cache with FreeCache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.common.config_fields import ranged
from pardec.inference.decoders.mdm_common import NONE, PREFIX, BlockRun, MDMDecoder, MDMDecoderConfig
from pardec.inference.decoders.mdm_lowconf import confidence


@dataclass
class MDMThresholdConfig(MDMDecoderConfig):
    name: str = "mdm_threshold"
    threshold: float = ranged(0.9, gt=0, le=1)
    # Fast-dLLM's prefix KV cache, refreshed at each block start (ignored when freecache=true).
    prefix_cache: bool = True


class MDMThresholdDecoder(MDMDecoder):
    name = "mdm_threshold"

    def __init__(self, cfg: MDMThresholdConfig, tokenizer):
        super().__init__(cfg, tokenizer)

    @property
    def default_cache(self) -> str:
        return PREFIX if self.cfg.prefix_cache else NONE

    def select(self, logits: torch.Tensor, masked: torch.Tensor, step: int, run: BlockRun) -> dict[int, int]:
        conf, tokens = confidence(logits, masked)  # [B], [B]
        chosen = conf >= self.cfg.threshold  # [B] (unmasked positions are -inf)
        chosen[int(conf.argmax())] = True  # always the top-1
        return {int(i): int(tokens[i]) for i in chosen.nonzero().flatten()}
