"""Autoregressive decoding (greedy or sampled) with an explicit ``DynamicCache``: the baseline and
the reference every parallel decoder is compared against.

One loop serves batch 1 and batched decoding. Prompts are left-padded; positions are explicit
(``cumsum(attention_mask) - 1``), so padding never shifts a sample's RoPE positions. After the
prefill of ``prompt[:-1]`` (see ``base``), each forward feeds every unfinished row its last token
and commits one token per row. A row that emits EOS or reaches ``max_new_tokens`` is removed from
the batch (and from the KV cache) before the next forward, so a sample's ``forwards`` is the
number of forwards its row took part in, which equals its committed tokens: TPF = 1 exactly,
batched or not. Batched decoding is numerically close to, but not guaranteed bit-identical with,
batch 1 (padding changes the kernels' reduction shapes); the AR greedy *reference* for agreement
metrics therefore runs at batch 1 by default.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pardec.common.config_fields import ranged
from pardec.common.errors import ConfigError
from pardec.common.kv_cache import cache_argument, left_pad
from pardec.common.metadata import AR, MASKED_AR
from pardec.inference.decoders.base import Decoder, DecoderConfig, DecodeResult, LoopTimer, model_device, prefill
from pardec.inference.decoders.decode_steps import StepsPool, causal_block
from pardec.inference.decoders.sampling import SamplingParams, make_generators, select_tokens


@dataclass
class ARDecoderConfig(DecoderConfig):
    name: str = "ar"
    greedy: bool = True
    temperature: float = ranged(1.0, gt=0)
    top_k: int = ranged(0, ge=0, note="0 = off")
    top_p: float = ranged(1.0, gt=0, le=1, note="1 = off")
    # Batch 1 over a StaticCache with the one-token step captured once as a CUDA graph and replayed
    # (pardec.inference.decoders.decode_steps); off a GPU the same static steps run eagerly.
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.cuda_graphs and self.batch_size != 1:
            raise ConfigError(f"config key 'decoder.batch_size' = {self.batch_size}: cuda_graphs=true decodes one "
                              "sample at a time (set decoder.batch_size=1)")


class ARDecoder(Decoder):
    name = "ar"
    # The checkpoint kinds it decodes (pardec.common.metadata.CHECKPOINT_KINDS): every causal next-token LM.
    checkpoint_kinds = (AR, MASKED_AR)

    def __init__(self, cfg: ARDecoderConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.sampling = SamplingParams(cfg.greedy, cfg.temperature, cfg.top_k, cfg.top_p)
        self.steps = StepsPool(cuda_graphs=True) if cfg.cuda_graphs else None

    @property
    def is_ar_greedy(self) -> bool:
        return self.sampling.greedy

    @torch.inference_mode()
    def decode(
        self,
        model,
        prompts: Sequence[Sequence[int]],
        eos_token_ids: Collection[int],
        seeds: Sequence[int],
    ) -> list[DecodeResult]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("AR decoding needs at least one prompt token per sample (got an empty prompt)")
        if self.steps is not None:
            return [self._decode_static(model, p, eos_token_ids, s) for p, s in zip(prompts, seeds, strict=True)]
        device = model_device(model)
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
        n = len(prompts)
        generators = make_generators(seeds, device)

        context, mask = left_pad([p[:-1] for p in prompts], pad_id=0, device=device)  # [n, s]
        cache = prefill(model, context, mask)
        tokens: list[list[int]] = [[] for _ in range(n)]
        forwards = [0] * n
        hit_eos = [False] * n
        live = list(range(n))  # sample index of each batch row still decoding
        step_ids = torch.tensor([[p[-1]] for p in prompts], device=device)  # [b, 1]
        positions = torch.tensor([[len(p) - 1] for p in prompts], device=device)  # [b, 1]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)  # [b, s+1]

        with LoopTimer(device) as timer:
            for _ in range(self.cfg.max_new_tokens):
                out = model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    **cache_argument(cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
                next_ids = select_tokens(out.logits[:, -1, :], self.sampling, [generators[i] for i in live])  # [b]
                done = torch.isin(next_ids, eos)  # [b]
                for sample, tok, stop in zip(live, next_ids.tolist(), done.tolist(), strict=True):
                    tokens[sample].append(tok)
                    forwards[sample] += 1
                    hit_eos[sample] = stop
                keep = [row for row, sample in enumerate(live) if not hit_eos[sample]]
                if not keep:
                    break
                if len(keep) < len(live):
                    cache.batch_select_indices(torch.tensor(keep, device=device))
                    live = [live[row] for row in keep]
                    next_ids, positions, mask = next_ids[keep], positions[keep], mask[keep]
                step_ids = next_ids.unsqueeze(1)  # [b, 1]
                positions = positions + 1
                mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=device)], dim=1)

        total_forwards = sum(forwards)
        return [
            DecodeResult(
                tokens=t,
                forwards=f,
                committed=len(t),
                wall_time_s=timer.elapsed * f / total_forwards,
                hit_eos=e,
            )
            for t, f, e in zip(tokens, forwards, hit_eos, strict=True)
        ]

    def _decode_static(self, model, prompt: Sequence[int], eos_token_ids: Collection[int], seed: int) -> DecodeResult:
        """One sample through :class:`StaticSteps` (``cuda_graphs``): the same loop at batch 1."""
        device = model_device(model)
        generators = make_generators([seed], device)
        steps = self.steps.get(model, len(prompt) + self.cfg.max_new_tokens + 1)
        steps.reset(prompt[:-1])
        block = causal_block(1, model.dtype, device)  # [1, 1, 1, 1]
        tokens, token, hit_eos = [], prompt[-1], False
        with LoopTimer(device) as timer:
            for _ in range(self.cfg.max_new_tokens):
                logits = steps.forward([token], block)  # [1, V]
                token = int(select_tokens(logits, self.sampling, generators)[0])
                tokens.append(token)
                if token in eos_token_ids:
                    hit_eos = True
                    break
        return DecodeResult(tokens=tokens, forwards=len(tokens), committed=len(tokens), wall_time_s=timer.elapsed,
                            hit_eos=hit_eos)
