"""Introspective Strided Decoding (ISD, docs/methods/idlm.md#isd-decoding): strict causal, KV cache, stride N.

References: I-DLM, Introspective Diffusion Language Models, arXiv:2604.11035 (§3.2, Algorithm 1,
Appendix B and F).

One forward per step. Every step feeds ``[pending, drafts, N-1 <|mask|>]`` after the KV cache:

* ``pending`` (1 token) is the last committed token, the only committed token whose K/V is not
  yet cached. Its query gives the causal anchor p_1 (the exact next-token distribution);
* ``drafts`` (0 or N-1 tokens) are the previous step's proposals; draft k is verified against
  p_k, computed at the query of the token before it (logit shift: pending for k = 1), and the
  query at the last draft gives p_N, the bonus token's distribution;
* the N-1 fresh masks take the positions right after the last draft; with the logit shift the
  mask at position j drafts the token at j+1 (never the one at j), exactly as the I-DLM x_t
  stream is trained (``pardec.data_pipelines.idlm_batch``).

The first step (bootstrap, no drafts: ``[last prompt token, N-1 masks]``) and every step after a
rejection are *propose* steps (N queries): they commit one exact token and draft N-1. The others
are *verify* steps (2N-1 queries): they check the N-1 drafts against their anchors and propose N-1
new drafts in the same forward::

    position      c     c+1   ...  c+N-1   c+N   ...  c+2N-2
    input         x_c   d_1   ...  d_N-1   M     ...  M          (x_c pending, K/V up to c-1 cached)
    predicts      c+1   c+2   ...  c+N     c+N+1 ...  c+2N-1
    role          p_1   p_2   ...  p_N     new drafts d'_1 .. d'_N-1 (masks never see x_{c+N})

Attention is the I-DLM training predicate (``pardec.masks.idlm.idlm_mask``) evaluated on this layout:
cached, pending and draft tokens form the clean stream x_0 (token-causal, they never see a mask);
the masks form one x_t block after the whole clean context (they see every clean token before
them and the masks before them). As the masks sit at the end this is plain causal attention, but
it is built from the same predicate as training, as a 4-D float additive mask of shape
``[1, 1, q, cache_len + q]`` (transformers returns a 4-D mask as is, with or without a cache),
so only the dense backends (sdpa, eager) are accepted. The predicate is evaluated once per step
shape and decode; each step pads that block to its cache length (:class:`StepMasks`).

Acceptance (draft k, anchor p_k, draft distribution q_k at the mask that proposed it):

* **greedy**: accept the longest prefix of drafts equal to ``argmax p_k``; at the first mismatch
  commit ``argmax p_k`` instead and drop the new drafts (the next step is a propose step). All
  accepted: the bonus token ``argmax p_N`` is committed and the new drafts are kept. Every
  committed token is thus the argmax of its causal anchor: token-identical to AR greedy (up to
  floating-point differences between query shapes, as for any speculative decoder; exact in the
  fp32 CPU tests).
* **sample**: drafts are *sampled* from q_k (the same temperature/top-k/top-p transform as p_k,
  :func:`pardec.inference.decoders.sampling.probs_from_logits`); accept with probability
  ``min(1, (1+tau) p_k(x)/q_k(x))``; on rejection commit a sample of
  ``normalize(max(0, p_k - q_k))`` (of p_k when that vanishes numerically) and drop the rest; all
  accepted: a bonus token sampled from p_N. With ``tau = 0`` and ``draft_mode: sample`` the output
  follows the AR sampling distribution exactly (speculative sampling, Leviathan et al. 2023).
  ``draft_mode: argmax`` (the official server's "fast" drafts) and ``tau > 0`` break that
  guarantee; the decoder warns and reports ``isd_distribution_exact = False``.

KV cache between steps: exactly the committed sequence (prompt + output) *minus its last token*,
i.e. ``len(prompt) + len(output) - 1`` entries at positions ``0 .. len-2``; that last token is
the next step's ``pending`` input. After each forward the cache is cropped back to the old cache
+ pending + accepted drafts (``DynamicCache.crop(-n)`` drops the last n entries), which removes
every MASK entry, the rejected drafts and the drafts past a rejection. The corrected / bonus token
is never in the cache when the step ends.

Counters (docs/methods/conventions.md#counting): ``forwards`` counts every decoding forward, the bootstrap
included (it commits x_{L+1}); the prefill of ``prompt[:-1]`` is excluded. ``stats`` per sample:
``stride``, ``propose_steps``, ``verify_steps``, ``reached[k-1]`` (verify steps in which draft k
was examined, i.e. drafts 1..k-1 were accepted) and ``accepted[k-1]`` (those in which draft k
was accepted too). ``accepted[k-1] / verify_steps`` is the paper's P_k (probability that the
first k drafts of a verify step are all accepted); see :mod:`pardec.inference.isd_metrics`. Acceptance is
counted on the verification outcome, before truncation at EOS or ``max_new_tokens``.

The decoder itself does not touch the ``<|mask|>`` logit: it uses the model's p and q as given, so
it reproduces whatever that model's AR decoding is. Checkpoints loaded for validation
(:func:`pardec.inference.checkpoint.load_checkpoint`) have the ``<|mask|>`` logit set to -inf, for AR and
ISD alike, so neither ever emits it and R-ISD's clean stream equals the base exactly.
:func:`introspective_acceptance` computes the
paper's alpha for any checkpoint with a mask token, independently of a decoding run.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import DynamicCache

from pardec.common.config_fields import Choice, ranged
from pardec.common.constants import METADATA_KEY
from pardec.common.errors import ConfigError
from pardec.common.metadata import MASKED_AR, CheckpointMetadata
from pardec.inference.decoders.base import DecoderConfig, DecodeResult, LoopTimer, PerSampleDecoder, model_device
from pardec.inference.decoders.decode_steps import StepsPool, dynamic_step
from pardec.inference.decoders.sampling import SamplingMode, SamplingParams, probs_from_logits
from pardec.inference.isd_metrics import isd_summary
from pardec.masks.core import AttentionSpec, additive_mask, dense_additive_mask, require_dense_attention
from pardec.masks.idlm import X0, XT, idlm_mask
from pardec.models.loading import mask_token_id


class DraftMode(Choice):
    """sample: drafts sampled from q (exact); argmax: "fast" argmax drafts, breaks the guarantee."""

    sample = "sample"
    argmax = "argmax"



@dataclass
class ISDDecoderConfig(DecoderConfig):
    name: str = "isd"
    # Stride N (one exact token + N-1 drafts per step); null = the checkpoint's pardec.isd_stride.
    stride: Optional[int] = ranged(None, ge=2)
    # greedy (lossless w.r.t. AR greedy) | sample (p/q acceptance, exact w.r.t. AR sampling).
    mode: SamplingMode = SamplingMode.greedy
    temperature: float = ranged(1.0, gt=0)
    top_k: int = ranged(0, ge=0, note="0 = off")
    top_p: float = ranged(1.0, gt=0, le=1, note="1 = off")
    # Relaxed acceptance min(1, (1 + tau) p/q); tau > 0 trades exactness for speed (sample mode).
    tau: float = ranged(0.0, ge=0)
    draft_mode: DraftMode = DraftMode.sample
    # Decode over a StaticCache with each step width (N, 2N-1) captured once as a CUDA graph and
    # replayed (pardec.inference.decoders.decode_steps); off a GPU the same static steps run eagerly.
    cuda_graphs: bool = False


def resolve_stride(model, stride: int | None) -> int:
    """``stride`` if given, else the checkpoint's recorded ``isd_stride``."""
    if stride is None:
        stride = CheckpointMetadata.of_model(model).isd_stride
        if stride is None:
            raise ConfigError(
                f"config key 'decoder.stride' is null and the checkpoint records no '{METADATA_KEY}.isd_stride' "
                "in its config.json: set decoder.stride=N"
            )
    if stride < 2:
        raise ConfigError(f"config key 'decoder.stride' = {stride}; ISD needs a stride N >= 2")
    return int(stride)


def step_attention_mask(cache_len: int, n_clean: int, n_masks: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask ``[1, 1, q, cache_len + q]`` (q = n_clean + n_masks) of one ISD step.

    Keys are the ``cache_len`` cached clean tokens then the q inputs (``n_clean`` clean tokens,
    then ``n_masks`` masks), at consecutive positions. The I-DLM training predicate is evaluated
    with the clean tokens as x_0 (block 0) and the masks as one x_t block (block 1).
    """
    n_kv = cache_len + n_clean + n_masks
    stream = torch.full((1, n_kv), X0, dtype=torch.long, device=device)  # [1, kv]
    stream[:, cache_len + n_clean :] = XT
    metadata = {
        "segment_ids": torch.zeros((1, n_kv), dtype=torch.long, device=device),
        "stream": stream,
        "block_ids": (stream == XT).long(),
        "position_ids": torch.arange(n_kv, device=device).unsqueeze(0),
    }
    # query i of the step is key cache_len + i
    return additive_mask(idlm_mask(**metadata), 1, n_clean + n_masks, n_kv, dtype, device, cache_len)


class StepMasks:
    """:func:`step_attention_mask` of every step of one decode, evaluated once per step shape.

    The cached keys are clean tokens before every query, and the I-DLM predicate lets every query
    (clean or mask) see all of them. So the mask of a step after ``cache_len`` cached tokens is its
    ``[q, q]`` block over the step's own keys, evaluated once per (clean, masks) shape, padded on
    the left with ``cache_len`` zero (visible) columns: a fill and a copy per step instead of the
    predicate's evaluation. ``tests/test_isd_decoder.py`` checks the result against
    :func:`step_attention_mask` at every cache length. (A view into one wide buffer would need no
    kernel at all, but its unaligned start crashed SDPA's memory-efficient CUDA kernel with a
    misaligned address on an H200.)
    """

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}

    def block(self, n_clean: int, n_masks: int) -> torch.Tensor:
        """Additive mask ``[1, 1, q, q]`` of a step over its own keys."""
        block = self._blocks.get((n_clean, n_masks))
        if block is None:
            block = step_attention_mask(0, n_clean, n_masks, self.dtype, self.device)  # [1, 1, q, q]
            self._blocks[(n_clean, n_masks)] = block
        return block

    def get(self, cache_len: int, n_clean: int, n_masks: int) -> torch.Tensor:
        """Additive mask ``[1, 1, q, cache_len + q]``, equal to ``step_attention_mask``."""
        return torch.nn.functional.pad(self.block(n_clean, n_masks), (cache_len, 0))  # [1, 1, q, cache_len + q]


def step_forward(
    model, cache: DynamicCache, clean: Sequence[int], mask_id: int, n_masks: int, masks: StepMasks | None = None
) -> torch.Tensor:
    """One ISD forward over ``[clean..., n_masks x <|mask|>]`` after ``cache``; logits ``[q, V]``.

    The inputs take positions ``cache_len ..``; their K/V are appended to ``cache`` (the caller
    crops it). ``masks``: the decode's :class:`StepMasks` (none: a fresh one for this step).
    """
    masks = masks or StepMasks(model.dtype, model_device(model))
    return dynamic_step(model, cache, list(clean) + [mask_id] * n_masks, masks.block(len(clean), n_masks))


class ISDDecoder(PerSampleDecoder):
    name = "isd"
    # The checkpoint kinds it decodes: a causal LM with a trained <|mask|> (an I-DLM export).
    checkpoint_kinds = (MASKED_AR,)

    def __init__(self, cfg: ISDDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.greedy = cfg.mode == "greedy"
        self.steps = StepsPool(cfg.cuda_graphs)
        self.sampling = SamplingParams(self.greedy, cfg.temperature, cfg.top_k, cfg.top_p)
        if not self.distribution_exact:
            warnings.warn(
                f"ISD sampling with draft_mode={cfg.draft_mode!r}, tau={cfg.tau}: outputs no longer follow the AR "
                "sampling distribution (exact only with draft_mode=sample, tau=0)",
                stacklevel=2,
            )

    @property
    def distribution_exact(self) -> bool:
        """Greedy: token-identical to AR greedy. Sample: distributed as AR sampling iff drafts are
        sampled from q and tau = 0."""
        return self.greedy or (self.cfg.draft_mode == "sample" and self.cfg.tau == 0)

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Acceptance aggregates merged into the validation metrics (see :mod:`pardec.inference.isd_metrics`)."""
        return {**isd_summary(records), "isd_distribution_exact": self.distribution_exact}

    @torch.inference_mode()
    def decode_one(self, model, prompt: list[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        if not prompt:
            raise ValueError("ISD decoding needs at least one prompt token (got an empty prompt)")
        require_dense_attention(model, "ISD decoding")
        stride = resolve_stride(model, self.cfg.stride)
        mask_id = mask_token_id(model, self.tokenizer)
        device = model_device(model)
        generator = torch.Generator(device=device).manual_seed(seed)
        n_drafts = stride - 1

        # 1. Prefill prompt[:-1]; the last prompt token is the first pending token (bootstrap).
        steps = self.steps.get(model, len(prompt) + self.cfg.max_new_tokens + 2 * stride, 2 * stride)
        steps.reset(prompt[:-1])
        pending = prompt[-1]
        drafts: list[int] = []
        draft_probs: torch.Tensor | None = None  # [N-1, V], q of the drafts (sample mode)
        out: list[int] = []
        hit_eos = False
        forwards = 0
        stats = {"stride": stride, "propose_steps": 0, "verify_steps": 0, "reached": [0] * n_drafts,
                 "accepted": [0] * n_drafts}
        masks = StepMasks(model.dtype, device)

        with LoopTimer(device) as timer:
            while True:
                # 2. One forward: [pending, drafts, N-1 masks] (N or 2N-1 queries).
                cache_len = steps.length
                clean = [pending] + drafts
                logits = steps.forward(clean + [mask_id] * n_drafts, masks.block(len(clean), n_drafts))  # [q, V]
                forwards += 1
                # greedy: one argmax and one device-to-host copy for the anchors and the new drafts
                argmax = logits.argmax(-1).tolist() if self.greedy else None  # [q]
                anchors = logits[: 1 + len(drafts)]  # [1+d, V]: row k predicts position cache_len+1+k
                mask_logits = logits[1 + len(drafts) :]  # [N-1, V]: the new drafts

                # 3. Verify the drafts against their anchors; always commits >= 1 token.
                if drafts:
                    stats["verify_steps"] += 1
                else:
                    stats["propose_steps"] += 1
                new_tokens, n_accepted = self._verify(anchors, drafts, draft_probs, generator, stats, argmax)

                # 4. Keep the K/V of pending + accepted drafts; drop masks and rejected drafts.
                steps.crop(cache_len + 1 + n_accepted)
                if n_accepted == len(drafts) and self.greedy:
                    drafts, draft_probs = argmax[1 + len(drafts) :], None
                elif n_accepted == len(drafts):
                    drafts, draft_probs = self._propose(mask_logits, generator)
                else:
                    drafts, draft_probs = [], None
                pending = new_tokens[-1]

                # 5. Commit up to EOS / max_new_tokens.
                for token in new_tokens[: self.cfg.max_new_tokens - len(out)]:
                    out.append(token)
                    if token in eos_token_ids:
                        hit_eos = True
                        break
                if hit_eos or len(out) >= self.cfg.max_new_tokens:
                    break

        return DecodeResult(
            tokens=out, forwards=forwards, committed=len(out), wall_time_s=timer.elapsed, hit_eos=hit_eos, stats=stats
        )

    def _propose(self, mask_logits: torch.Tensor, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """Sample mode's drafts from the mask logits ``[N-1, V]``: sampled from q, or its argmax
        ("fast" drafts); greedy mode takes the argmax of the step's logits instead."""
        q = probs_from_logits(mask_logits, self.sampling)  # [N-1, V]
        if self.cfg.draft_mode == "argmax":
            return q.argmax(-1).tolist(), q
        return torch.multinomial(q, 1, generator=generator).squeeze(1).tolist(), q

    def _verify(
        self,
        anchors: torch.Tensor,
        drafts: list[int],
        draft_probs: torch.Tensor | None,
        generator: torch.Generator,
        stats: dict[str, Any],
        argmax: list[int] | None,
    ) -> tuple[list[int], int]:
        """``(tokens to commit, accepted drafts)``: the accepted drafts then one corrected or bonus
        token. ``anchors [1+d, V]``: row k is p_{k+1}, the anchor of draft k+1 (row d: the bonus);
        ``argmax`` (greedy): the argmax of every row of the step, anchors first."""
        if self.greedy:
            targets = argmax  # row k < 1+d: argmax p_{k+1}
            for k, draft in enumerate(drafts):
                stats["reached"][k] += 1
                if draft != targets[k]:
                    return drafts[:k] + [targets[k]], k
                stats["accepted"][k] += 1
            return drafts + [targets[len(drafts)]], len(drafts)

        p = probs_from_logits(anchors, self.sampling)  # [1+d, V]
        for k, draft in enumerate(drafts):
            stats["reached"][k] += 1
            q = draft_probs[k]  # [V]
            ratio = (1 + self.cfg.tau) * p[k, draft] / q[draft]
            if torch.rand((), generator=generator, device=p.device) >= ratio:
                residual = (p[k] - q).clamp(min=0)  # [V]
                if residual.sum() <= 0:
                    residual = p[k]
                corrected = int(torch.multinomial(residual, 1, generator=generator))
                return drafts[:k] + [corrected], k
            stats["accepted"][k] += 1
        bonus = int(torch.multinomial(p[len(drafts)], 1, generator=generator))
        return drafts + [bonus], len(drafts)


@torch.inference_mode()
def introspective_ratios(
    model, prompt_ids: Sequence[int], generated_ids: Sequence[int], mask_token_id: int, stride: int
) -> torch.Tensor:
    """``min(1, p_k(x_k) / q_k(x_k))`` for every *drafted* generated token, ``[n]`` float32 (one forward).

    Paper §2 (arXiv:2604.11035): alpha = (1/L) sum_k min(1, p_k(x_k)/q_k(x_k)), q_k the distribution
    the token was generated from, p_k the causal distribution with every token revealed. Here the
    generation is laid out as ISD at stride N with every draft accepted: the generated tokens
    g_0 g_1 ... (positions L, L+1, ... after a prompt of length L) form strides of N tokens
    ``g_{sN} .. g_{sN+N-1}``, s = 0, 1, ...; with ``c_s = L-1+sN`` the last clean position before
    stride s:

    * g_{sN} is the stride's exact token (the clean query at c_s gives it, q = p): not counted;
    * g_{sN+j}, j = 1..N-1, is drafted by the mask at position ``c_s + j`` of the block of N-1
      masks placed after the clean context ``x_{<=c_s}`` (I-DLM x_t -> x_0 / x_t -> x_t rules):
      ``q_k = softmax(logits)`` at that mask;
    * ``p_k = softmax(logits)`` of the clean (causal, token-revealed) query at position ``k-1``.

    Distributions are the model's raw softmax (temperature 1, no top-k/top-p), so alpha measures
    the model, not a decoding configuration. A single forward computes both: the clean sequence
    ``prompt + generated`` (x_0) followed by one x_t block of masks per stride, masked with the
    I-DLM training predicate (clean block ids chosen so each mask block sees exactly x_{<=c_s}).
    """
    if stride < 2:
        raise ValueError(f"introspective acceptance needs a stride N >= 2, got {stride}")
    if not prompt_ids:
        raise ValueError("introspective acceptance needs at least one prompt token")
    require_dense_attention(model, "introspective_acceptance")
    device = model_device(model)
    n_prompt, n_gen = len(prompt_ids), len(generated_ids)
    clean = torch.tensor(list(prompt_ids) + list(generated_ids), dtype=torch.long)  # [S]
    clean_pos = torch.arange(clean.numel())  # [S]
    clean_block = torch.where(clean_pos < n_prompt, 0, (clean_pos - n_prompt) // stride + 1)  # [S]

    # 1. One mask per drafted token g (g % N != 0): at position L-1+g, in block (g // N) + 1.
    drafted = torch.tensor([g for g in range(n_gen) if g % stride != 0], dtype=torch.long)  # [M]
    mask_pos = n_prompt - 1 + drafted  # [M]; also the clean anchor position of each drafted token
    metadata = {
        "segment_ids": torch.zeros(1, clean.numel() + drafted.numel(), dtype=torch.long),
        "stream": torch.cat([torch.full_like(clean, X0), torch.full_like(drafted, XT)]).unsqueeze(0),
        "block_ids": torch.cat([clean_block, drafted // stride + 1]).unsqueeze(0),
        "position_ids": torch.cat([clean_pos, mask_pos]).unsqueeze(0),
    }  # each [1, S+M]
    spec = AttentionSpec(idlm_mask, metadata).to(device)
    ids = torch.cat([clean, torch.full_like(drafted, mask_token_id)]).unsqueeze(0).to(device)  # [1, S+M]

    # 2. p at the clean query before each drafted token, q at its mask.
    logits = model(
        input_ids=ids,
        attention_mask=dense_additive_mask(spec, model.dtype),  # [1, 1, S+M, S+M]
        position_ids=spec.metadata["position_ids"],
    ).logits[0].float()  # [S+M, V]
    targets = clean[n_prompt + drafted].to(device)  # [M]
    anchor_rows = mask_pos.to(device)  # clean rows: buffer index == position
    p = torch.softmax(logits[anchor_rows], -1).gather(-1, targets[:, None]).squeeze(1)  # [M]
    q = torch.softmax(logits[clean.numel() :], -1).gather(-1, targets[:, None]).squeeze(1)  # [M]
    return (p / q).nan_to_num(nan=1.0, posinf=1.0).clamp(max=1.0)


def introspective_acceptance(
    model, prompt_ids: Sequence[int], generated_ids: Sequence[int], mask_token_id: int, stride: int
) -> float:
    """Introspective acceptance rate alpha of ``generated_ids`` after ``prompt_ids``: the mean of
    :func:`introspective_ratios` over the drafted tokens (needs at least 2 generated tokens).
    To pool several samples, concatenate their ratios and take one mean."""
    ratios = introspective_ratios(model, prompt_ids, generated_ids, mask_token_id, stride)
    if ratios.numel() == 0:
        raise ValueError("introspective acceptance needs at least 2 generated tokens (the first one is never drafted)")
    return float(ratios.mean())
