"""FlashDLM AR-guided diffusion: the MDM drafts the block, a causal AR guide verifies the drafts.

References: FlashDLM, Accelerating Diffusion LLM Inference via Efficient KV Caching and Guided
Diffusion, arXiv:2505.21467 (§3.2.2, Algorithm 1; Appendix C.4, relaxed matching).

Each step: one DLM forward drafts *every* still-masked position of the current block (argmax;
with prefix commits they are always the block's suffix ``[m, e)``); one guide forward over
``[x_{m-1}, d_m, ..., d_{e-1}]`` after the guide's own KV cache (the committed sequence minus its
last token; prompt[:-1] is the guide's prefill, not counted) gives the guide's distribution g_k
for each position m + k. Draft k is *accepted* if

* ``acceptance=strict``: it is the guide's argmax;
* ``acceptance=relaxed``: it is in the guide's top-2 and ``g_k(d) >= relaxed_ratio * g_k(top)``
  (the paper's near-tie rule, ratio 0.5; the official code's ``top_p`` key defaults to 0.95).

With n = the longest accepted prefix:

* ``commit=assisted`` (default; Algorithm 1): commit d_m .. d_{m+n-1}, or d_m alone when n = 0;
* ``commit=shifted`` (the other official variant): commit the n accepted drafts plus, when a draft
  was rejected, the guide's argmax at that position. With strict acceptance every committed token
  is then the guide's greedy choice after the committed prefix: the output equals the guide's AR
  greedy output token for token (lossless w.r.t. the guide).

The guide cache is cropped to the new committed prefix minus its last token; its forwards run
through :mod:`pardec.inference.decoders.decode_steps` (with ``cuda_graphs`` static, each width a
CUDA graph, as the DLM's). ``freecache=true`` runs the DLM forwards with FreeCache
(:mod:`pardec.inference.decoders.mdm_common`). ``decoder.guide`` names
the guide's export (validation loads it once: ``self.auxiliary["guide"]``); by default the
benchmark passes the AR base the MDM was converted from. Its tokenizer must be the MDM's minus
``<|mask|>`` (checked once, :class:`ConfigError` otherwise), and it must be causal.

Counting: ``stats["dlm_forwards"]`` and ``stats["guide_forwards"]`` separately; ``forwards`` is
their sum (TPF over all forwards); ``summarize`` adds the TPF over DLM forwards alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pardec.common.config_fields import Choice, ranged
from pardec.common.constants import MASK_TOKEN, METADATA_KEY
from pardec.common.errors import ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.inference.decoders.base import forbid_mask, model_device
from pardec.inference.decoders.decode_steps import SMALL, DynamicSteps, StaticSteps, StepsPool, causal_block
from pardec.inference.decoders.mdm_common import BlockRun, MDMDecoder, MDMDecoderConfig


class Commit(Choice):
    assisted = "assisted"
    shifted = "shifted"


class Acceptance(Choice):
    strict = "strict"
    relaxed = "relaxed"



@dataclass
class MDMGuidedConfig(MDMDecoderConfig):
    name: str = "mdm_guided"
    # Export directory of the causal AR guide (same tokenizer as the MDM, minus <|mask|>).
    guide: str | None = None
    commit: Commit = Commit.assisted
    acceptance: Acceptance = Acceptance.strict
    # Relaxed acceptance: draft in the guide's top-2 with p(draft) >= relaxed_ratio * p(top).
    relaxed_ratio: float = ranged(0.5, gt=0, le=1)


def check_guide_tokenizer(guide, tokenizer) -> None:
    """The guide's tokenizer (loaded from its export) must be the MDM's without ``<|mask|>``."""
    source = getattr(guide.config, "_name_or_path", "")
    if not source or not Path(source).is_dir():
        raise ConfigError(
            "decoder.guide: cannot check the guide's tokenizer: the guide model has no export directory "
            f"(config._name_or_path={source!r}); load it from its export"
        )
    guide_vocab = AutoTokenizer.from_pretrained(source).get_vocab()
    mdm_vocab = {tok: i for tok, i in tokenizer.get_vocab().items() if tok != MASK_TOKEN}
    if guide_vocab != mdm_vocab:
        differing = sorted(set(guide_vocab.items()) ^ set(mdm_vocab.items()))[:5]
        raise ConfigError(
            f"decoder.guide={source}: the guide's tokenizer differs from the MDM's (besides {MASK_TOKEN}): "
            f"{len(guide_vocab)} vs {len(mdm_vocab)} tokens, e.g. {differing}; guided decoding compares token ids, "
            "so the guide must share the MDM's tokenizer"
        )
    attention = CheckpointMetadata.of_model(guide).attention
    if attention not in (None, "causal"):
        raise ConfigError(f"decoder.guide={source} records {METADATA_KEY}.attention={attention!r}; the guide must be a "
                          "causal AR model")


class MDMGuidedDecoder(MDMDecoder):
    name = "mdm_guided"
    auxiliary_fields = ("guide",)

    def __init__(self, cfg: MDMGuidedConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self._checked_guide = None
        self.guide_steps = StepsPool(cfg.cuda_graphs)  # the guide's steps (causal), static with cuda_graphs
        self._steps: DynamicSteps | StaticSteps | None = None

    @property
    def guide(self):
        guide = self.auxiliary.get("guide")
        if guide is None:
            raise ConfigError("decoder.guide is not set: mdm_guided needs an AR guide export (decoder.guide=<dir>)")
        if self._checked_guide is not guide:
            check_guide_tokenizer(guide, self.tokenizer)
            self._checked_guide = guide
        return guide

    @contextlib.contextmanager
    def prepare(self, model) -> Iterator[None]:
        _ = self.guide  # named errors before the run
        with super().prepare(model):
            yield

    def begin(self, run: BlockRun, prompt: list[int]) -> None:
        widest = 1 + run.block  # [x_{m-1}, drafts]
        self._steps = self.guide_steps.get(self.guide, len(prompt) + self.cfg.max_new_tokens + widest + SMALL, widest)
        self._steps.reset(prompt[:-1])

    def select(self, logits: torch.Tensor, masked: torch.Tensor, step: int, run: BlockRun) -> dict[int, int]:
        first = int(masked.nonzero()[0])
        if not bool(masked[first:].all()):
            raise RuntimeError("guided decoding expects the masked positions to be the block's suffix")
        drafts = logits[first:].argmax(-1)  # [d]
        s, _ = run.span(run.current)
        m = s + first  # absolute position of the first draft
        guide = self.guide

        # 1. Guide forward over [x_{m-1}, drafts] after the cache of positions < m - 1 (causal).
        assert self._steps.length == m - 1, (self._steps.length, m - 1)
        fed = [int(run.x[m - 1])] + drafts.tolist()  # [1 + d]
        logits = self._steps.forward(fed, causal_block(len(fed), guide.dtype, model_device(guide)))  # [1 + d, V]
        run.guide_forwards += 1
        # [d, V]: row k is the guide at m + k. <|mask|> is not in the guide's tokenizer, but its id may be a padding
        # row of the guide's output; committed (commit=shifted) it would leave the position masked forever.
        g = torch.softmax(forbid_mask(logits[:-1].float(), run.info.mask_id), dim=-1)
        top2_p, top2 = g.topk(2, dim=-1)  # [d, 2]

        # 2. Longest accepted prefix of drafts.
        n = 0
        for k, draft in enumerate(drafts.tolist()):
            if draft == int(top2[k, 0]) or (self.cfg.acceptance == "relaxed" and draft == int(top2[k, 1])
                  and float(top2_p[k, 1]) >= self.cfg.relaxed_ratio * float(top2_p[k, 0])):
                n += 1
            else:
                break
        run.extra["drafts_accepted"] = run.extra.get("drafts_accepted", 0) + n
        run.extra["drafts_verified"] = run.extra.get("drafts_verified", 0) + drafts.numel()

        # 3. Commit, then keep the guide cache of the committed prefix minus its last token.
        commits = {first + k: int(drafts[k]) for k in range(n)}
        if n < drafts.numel():
            if self.cfg.commit == "shifted":
                commits[first + n] = int(top2[n, 0])
            elif n == 0:
                commits[first] = int(drafts[0])
        self._steps.crop(m + len(commits) - 1)
        return commits

    def summarize(self, records):
        out = super().summarize(records)
        verified = sum(r["stats"].get("drafts_verified", 0) for r in records)
        accepted = sum(r["stats"].get("drafts_accepted", 0) for r in records)
        out["guide_acceptance"] = accepted / verified if verified else 0.0
        return out

