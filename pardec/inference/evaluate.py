"""Evaluation core: decode an eval set with a decoder, score it, aggregate metrics.

:func:`evaluate` (records + metrics) is the core of ``pardec/cli/validate.py``;
:func:`evaluate_model` (metrics only) is the trainer's periodic-evaluation hook for a model
already in memory (pass the bare module, not a DeepSpeed engine). Prompts are formatted exactly as
training saw them (:func:`pardec.data_pipelines.tokenize.format_prompt_ids`: ``plain`` = the prompt text
tokenised without special tokens, ``chat`` = the tokenizer's chat template with the generation
prompt, ``auto`` (the default, as ``data.template``) = chat for a tokenizer with a chat template,
else plain, so a benchmark that does not name a template renders a chat model's prompts as its
training did); with ``add_bos`` a plain prompt is prefixed with the tokenizer's BOS when it has one.

When a process group with more than one rank is running and ``shard`` is true, each rank decodes
its strided shard and rank 0 gathers the records (see ``pardec.inference.distributed``); the metrics are
broadcast to every rank. Under ZeRO-3 every rank must run the same forwards: pass ``shard=False``
there (each rank then decodes the whole set; greedy decoding keeps them in lockstep).

For a decoder other than AR greedy, ``agreement=True`` also decodes the same prompts with AR
greedy (at ``reference_batch_size``, 1 by default so the reference is exact) and stores its output
in each record as ``reference_ids`` for the agreement metrics; on a checkpoint AR greedy does not
decode (an MDM export: bidirectional or block attention, shifted logits) there is no AR reference and
``reference_ids`` is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
from omegaconf import DictConfig
from tqdm import tqdm

from pardec.common.attention import without_flex_attention
from pardec.common.distributed import DistInfo, current
from pardec.common.errors import DataError
from pardec.common.kv_cache import cached_step_attention
from pardec.common.metadata import CheckpointMetadata, model_where
from pardec.data_pipelines.tokenize import format_prompt_ids, resolve_template, stop_token_ids
from pardec.inference.checkpoint import forbid_output_token
from pardec.inference.decoders.ar import ARDecoder, ARDecoderConfig
from pardec.inference.decoders.base import Decoder, DecoderConfig
from pardec.inference.decoders.registry import build_decoder, check_checkpoint_kind
from pardec.inference.decoders.sampling import sample_seed
from pardec.inference.distributed import broadcast_object, gather_records, shard_indices
from pardec.inference.metrics import compute_metrics, gold_answer, score_answer


@dataclass
class EvalResult:
    metrics: dict[str, Any]  # on every rank
    records: list[dict[str, Any]]  # per sample, sorted by index; rank 0 only (empty elsewhere)


def evaluate_model(model, tokenizer, eval_dataset: datasets.Dataset, decoder_cfg, **kwargs) -> dict[str, Any]:
    """Metrics only (same on every rank); keyword arguments as for :func:`evaluate`.

    A model being converted has ``<|mask|>`` in its vocabulary (recorded in its metadata) but is
    not loaded through ``load_checkpoint``; as an exported checkpoint would, it never emits it here:
    the token's logit is forbidden for the evaluation only (the training forwards are untouched).
    """
    mask_id = CheckpointMetadata.of_model(model).mask_token_id
    handle = forbid_output_token(model, mask_id) if mask_id is not None else None
    try:
        with without_flex_attention(model):  # a model loaded for training may hold FlexAttention (GPU)
            return evaluate(model, tokenizer, eval_dataset, decoder_cfg, **kwargs).metrics
    finally:
        if handle is not None:
            handle.remove()


def evaluate(
    model,
    tokenizer,
    eval_dataset: datasets.Dataset,
    decoder_cfg: Mapping[str, Any] | DictConfig | DecoderConfig,
    *,
    template: str = "auto",
    add_bos: bool = False,
    agreement: bool = True,
    reference_batch_size: int = 1,
    shard: bool = True,
    progress: bool = False,
    auxiliary: Mapping[str, Any] | None = None,
    first_index: int = 0,
) -> EvalResult:
    """Decode ``eval_dataset`` (columns ``prompt``, ``response``, optional ``answer``) and score it.

    ``decoder_cfg`` is a decoder config (e.g. ``{"name": "ar", "max_new_tokens": 128,
    "batch_size": 16}``), validated by ``pardec.inference.decoders.registry``. The model's train/eval
    mode is restored on return. ``auxiliary``: the models the decoder's config names (see
    ``Decoder.auxiliary_fields``), keyed by config field. ``first_index``: the problem number of the
    dataset's first row; the records' ``index`` and each problem's seed count from it, so a split decoded
    in parts (``pardec.benchmarks.chunks``) gives every problem the index and seed it has in one call.
    """
    decoder = build_decoder(decoder_cfg, tokenizer)
    metadata = CheckpointMetadata.of_model(model)
    check_checkpoint_kind(decoder.cfg.name, metadata, model_where(model))
    decoder.use_auxiliary(auxiliary or {})
    template = resolve_template(tokenizer, template)  # a chat template the tokenizer lacks is named here
    ctx = current() if shard else DistInfo()
    local = shard_indices(len(eval_dataset), ctx)
    rows = [eval_dataset[i] for i in local]
    indices = [first_index + i for i in local]
    prompts = [encode_prompt(tokenizer, row["prompt"], template, add_bos, i) for i, row in zip(indices, rows)]
    eos = eos_token_ids(model, tokenizer)
    show = progress and ctx.is_main

    was_training = model.training
    model.eval()
    try:
        with decoder.prepare(model):
            results = run_decoder(model, decoder, prompts, indices, eos, show, "decode")
        references = None  # after prepare's exit: the reference sees the model as loaded
        if agreement and not decoder.is_ar_greedy and metadata.kind in ARDecoder.checkpoint_kinds:
            ref_cfg = ARDecoderConfig(max_new_tokens=decoder.cfg.max_new_tokens, batch_size=reference_batch_size)
            references = run_decoder(model, ARDecoder(ref_cfg, tokenizer), prompts, indices, eos, show, "AR reference")
    finally:
        model.train(was_training)

    records = []
    for k, (index, row, prompt, result) in enumerate(zip(indices, rows, prompts, results, strict=True)):
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        gold = gold_answer(row)
        predicted, correct = score_answer(text, gold)
        records.append(
            {
                "index": index,
                "rank": ctx.rank,
                "prompt": row["prompt"],
                "prompt_tokens": len(prompt),
                "output_text": text,
                "output_ids": result.tokens,
                "committed": result.committed,
                "forwards": result.forwards,
                "wall_time_s": result.wall_time_s,
                "hit_eos": result.hit_eos,
                "answer": gold,
                "predicted": predicted,
                "correct": correct,
                "reference_ids": references[k].tokens if references is not None else None,
                "stats": result.stats,
            }
        )
    records = gather_records(records, ctx)
    metrics = compute_metrics(records, decoder.is_ar_greedy) if ctx.is_main else None
    if metrics is not None:
        metrics.update(decoder.summarize(records))  # decoder-specific aggregates (e.g. ISD acceptance)
    return EvalResult(metrics=broadcast_object(metrics, ctx), records=records)


def run_decoder(
    model,
    decoder: Decoder,
    prompts: Sequence[list[int]],
    indices: Sequence[int],
    eos: set[int],
    progress: bool,
    desc: str,
) -> list:
    """Decode ``prompts`` in chunks of ``decoder.cfg.batch_size``; one result per prompt. Without
    cuDNN attention (:func:`pardec.common.kv_cache.cached_step_attention`: a cached step's shape is new at
    every step)."""
    size = decoder.cfg.batch_size
    results = []
    with cached_step_attention():
        for start in tqdm(range(0, len(prompts), size), desc=desc, disable=not progress):
            seeds = [sample_seed(decoder.cfg.seed, i) for i in indices[start : start + size]]
            results += decoder.decode(model, prompts[start : start + size], eos, seeds)
    return results


def encode_prompt(tokenizer, prompt: str, template: str, add_bos: bool, index: int) -> list[int]:
    template = resolve_template(tokenizer, template)
    ids = format_prompt_ids(tokenizer, prompt, template)
    bos = tokenizer.bos_token_id
    if add_bos and template == "plain" and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    if not ids:
        raise DataError(
            f"eval sample {index} has an empty prompt after formatting (template={template!r}); decoding needs at "
            "least one prompt token: set add_bos=true with a tokenizer that has a BOS token, or drop such samples"
        )
    return ids


def eos_token_ids(model, tokenizer) -> set[int]:
    """Where decoding stops: :func:`pardec.data_pipelines.tokenize.stop_token_ids` of the tokenizer
    and the model's generation config (EOS and the chat template's end of turn)."""
    return stop_token_ids(tokenizer, getattr(model, "generation_config", None))
