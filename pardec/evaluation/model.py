"""The lm-evaluation-harness model ``pardec``: a pardec checkpoint whose generations come from a pardec decoder.

Run it with ``pardec-lm-eval`` (lm-eval's own CLI with this model registered: lm-eval 0.4 discovers models
only through its registry, with no entry point or plugin for external packages, so the plain ``lm_eval``
command does not know ``pardec``)::

    pardec-lm-eval --model pardec --model_args checkpoint=<export>,decoder=jacobi,block_size=16 \\
        --tasks gsm8k --output_path lm_eval_results

From Python, importing this module registers the model: ``lm_eval.simple_evaluate(model="pardec",
model_args="checkpoint=...,decoder=...", ...)``, or pass a :class:`PardecLM` instance.

**model_args.** ``checkpoint`` (required, a local export) and ``decoder`` (a ``pardec-validate
decoder=<choice>`` preset of ``pardec/recipes/decoder/``, default ``ar_greedy``); ``device``, ``dtype``,
``attn_implementation`` and ``add_bos`` are validation's keys of those names; ``max_length`` is lm-eval's
token budget (context plus generation; default the model's positions); every other key is a decoder key
(``block_size=16`` is validation's ``decoder.block_size=16``). The config is composed as ``pardec-validate`` composes it
(:func:`pardec.inference.compose.compose_validate_config`), the checkpoint and the decoder's auxiliary models
are loaded as validation loads them (:func:`pardec.inference.checkpoint.load_for_decoding`), so defaults and
errors are validation's (a decoder that cannot decode the checkpoint's kind is refused before anything is
decoded). lm-eval's ``--batch_size`` (default 1) is the decoder's batch size (prompts per
``decode`` call, batched where the decoder batches) and the batch of the loglikelihood forwards; ``auto`` is
refused. lm-eval's ``--device`` is validation's ``device`` (:func:`harness_device`).

**generate_until.** Each context is tokenised as validation tokenises a plain-template prompt
(:func:`pardec.inference.evaluate.encode_prompt`: no special tokens, BOS first with ``add_bos=true``), which is
lm-eval's HF model with ``add_bos_token`` equal to ``add_bos``, and left-truncated as HF truncates it (to
``max_length - max_gen_toks``). The request's ``max_gen_toks`` (default: the decoder's ``max_new_tokens``)
becomes ``decoder.max_new_tokens``. Decoders stop where HF's ``generate`` stops by id: the generation
config's EOS ids and the stop strings that are one special token (the EOS text lm-eval adds, ``<|im_end|>``);
the other stop strings are applied afterwards exactly where lm-eval's HF model stops and cuts
(:mod:`pardec.evaluation.stopping`). Validation also stops at a chat template's end-of-turn token; HF, and so
this model, only when it is one of those. Sampling is the decoder's choice
(``decoder=ar_sample,temperature=0.7``): request keys such as ``do_sample=true`` or ``top_p`` are reported
once as ignored. Document ``d`` (repeat 0)
is decoded with seed index ``d``, as validation decodes eval row ``d``; repeat ``r`` uses ``d + r * 2**32``.

**loglikelihood, loglikelihood_rolling.** lm-eval's HF implementation on the loaded model, for checkpoints
with an AR head: the checkpoint kinds (:attr:`pardec.common.metadata.CheckpointMetadata.kind`) ``ar`` and
``masked-ar`` (a plain AR model and the ``ar``, ``jacobi_forcing``, ``idlm``, ``idlm_lora`` and ``refusion``
exports: causal attention and a next-token loss on clean text; the ``<|mask|>`` logit stays at -inf as
loaded, so the distribution is over the original vocabulary). An MDM export (``mdm-bidirectional``,
``mdm-block``) predicts masked tokens, not the next token of a clean prefix: these requests raise a
:class:`CheckpointError` naming the checkpoint and its kind. An MDM therefore runs generation tasks
(``gsm8k``, ``humaneval``, ``mbpp``, ``minerva_math``, ``ifeval``, ``pardec_synthetic_gsm``), not
multiple-choice or perplexity tasks (``mmlu``, ``hellaswag``, ``arc_*``, ``wikitext``).

**Decoder stats.** Per task, validation's aggregates over the generated requests
(:func:`pardec.inference.metrics.compute_metrics`: ``tpf``, ``nfe``, ``nfe_per_sample``, ``tps``,
``decode_time_s``, ``mean_new_tokens``, ``eos_rate``) plus the decoder's own summary (revisions and
flip-flops of the MDM decoders, ISD acceptance, ...), counted on the decoder's whole output (forwards
spent past a text stop string included), never on lm-eval's padding copies. They are printed after the
generation and returned by :meth:`PardecLM.get_model_info`, which lm-eval merges into the ``config`` of its
results, so they are written in the results file under ``config.pardec.decoder_stats.<task>``
(``--output_path run.json`` writes ``run_<date>.json``; a directory gets ``<dir>/<name>/results_<date>.json``
with a random ``<name>``, lm-eval naming it after a ``pretrained=`` argument, which this model has not).

**Multi-GPU: lm-eval's own data parallelism**, launched with ``torchrun``::

    torchrun --nproc_per_node 8 -m pardec.cli.lm_eval_harness --model pardec --model_args ... --tasks gsm8k

lm-eval shards the documents by rank, pads the ranks to equal request counts, gathers the per-document
metrics and logged samples and writes on rank 0; pardec's ``torchrun`` validation shards its own eval set
and never sees lm-eval's requests, so it cannot serve here. The process group is pardec's
(:func:`pardec.common.distributed.init_distributed` from the launcher's environment; each rank decodes on
its local GPU) and :class:`PardecLM` reports its rank and world and implements lm-eval's ``all_gather``,
``gather_object`` and ``barrier`` on ``torch.distributed`` (lm-eval's HF model would use Accelerate, which
it turns off for an already loaded model). The decoder stats are gathered to rank 0.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from pardec.common.distributed import barrier, init_distributed, shutdown_at_exit
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import AR, MASKED_AR, CheckpointMetadata, model_where
from pardec.evaluation.stopping import generation_eos_ids, hf_continuation, special_stop_ids
from pardec.inference.checkpoint import load_for_decoding
from pardec.inference.compose import compose_validate_config
from pardec.inference.decoders.registry import build_decoder, check_checkpoint_kind, decoder_config
from pardec.inference.distributed import gather_records
from pardec.inference.evaluate import encode_prompt, run_decoder
from pardec.inference.metrics import compute_metrics, format_markdown

logger = logging.getLogger(__name__)

# model_args that are validation's top-level keys; every other key is a decoder key.
VALIDATE_KEYS = ("device", "dtype", "attn_implementation", "add_bos")
# Request keys the decoder's config replaces (anything else is reported as ignored).
HONOURED_GEN_KWARGS = {"until", "max_gen_toks"}
REPEAT_STRIDE = 2**32


def validate_overrides(checkpoint: str, decoder: str, keys: Mapping[str, Any]) -> list[str]:
    """Hydra overrides of ``pardec-validate`` for lm-eval's model_args (values as lm-eval parsed them)."""
    overrides = [f"checkpoint={checkpoint}", f"decoder={decoder}"]
    for key, value in keys.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        overrides.append(f"{key}={text}" if key in VALIDATE_KEYS else f"decoder.{key}={text}")
    return overrides


def harness_device(device: str) -> str:
    """lm-eval's ``--device`` (its CLI passes ``cuda:0`` unless told otherwise) as validation's ``device``: ``auto``
    under a multi-process launch (each rank takes its local GPU) and for a CUDA device without CUDA (then the
    CPU, as lm-eval's HF model falls back)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or (device.startswith("cuda") and not torch.cuda.is_available()):
        return "auto"
    return device


@register_model("pardec")
class PardecLM(HFLM):
    def __init__(
        self,
        checkpoint: str,
        decoder: str = "ar_greedy",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | None = None,
        **keys: Any,
    ) -> None:
        del max_batch_size  # lm-eval's bound for batch_size=auto, which is refused
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ConfigError(f"--batch_size {batch_size!r}: the pardec model needs a positive integer (no 'auto')")
        if device is not None:
            keys = {**keys, "device": harness_device(device)}
        self.cfg = compose_validate_config(validate_overrides(checkpoint, decoder, keys))
        self.dist = init_distributed()
        shutdown_at_exit(self.dist)
        model, tokenizer, self.auxiliary = load_for_decoding(self.cfg)
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            backend="causal",
            batch_size=int(batch_size),
            max_length=max_length,
            add_bos_token=self.cfg.add_bos,
        )
        self._rank, self._world_size = self.dist.rank, self.dist.world_size
        self.decoder_choice = decoder
        self.decoder_cfg = replace(decoder_config(self.cfg.decoder), batch_size=int(batch_size))
        self.metadata = CheckpointMetadata.of_model(model)
        check_checkpoint_kind(self.decoder_cfg.name, self.metadata, model_where(model))  # as validation does
        self.records: dict[str, list[dict[str, Any]]] = defaultdict(list)  # rank 0: every rank's, per task
        self.warned_gen_kwargs: set[str] = set()

    # -- generation -------------------------------------------------------------------------------

    @property
    def max_gen_toks(self) -> int:
        return self.decoder_cfg.max_new_tokens

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """One continuation per request, in request order (see the module docstring)."""
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(i)
        occurrences: Counter = Counter()
        repeat = []
        for request in requests:
            repeat.append(occurrences[id(request)])
            occurrences[id(request)] += 1
        records = []
        for members in groups.values():
            records += self._generate_group(requests, members, repeat, outputs, disable_tqdm)
        self._add_stats(records)
        return outputs

    def _generate_group(self, requests, members, repeat, outputs, disable_tqdm) -> list[dict[str, Any]]:
        """Decode ``requests[i]`` for ``i`` in ``members`` (one generation-kwargs group) into ``outputs``;
        returns their stats records."""
        kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
        self._warn_ignored(kwargs)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id, False))
        max_gen = kwargs.pop("max_gen_toks")
        if self.max_length - max_gen < 1:
            raise ConfigError(f"max_gen_toks={max_gen} leaves no context within max_length={self.max_length}")
        index = {i: requests[i].doc_id + repeat[i] * REPEAT_STRIDE for i in members}
        encoded = {i: self._prompt(requests[i].args[0], index[i], self.max_length - max_gen) for i in members}
        members = sorted(members, key=lambda i: -len(encoded[i]))  # longest first, as HF batches
        indices, prompts = [index[i] for i in members], [encoded[i] for i in members]
        decoder = build_decoder(replace(self.decoder_cfg, max_new_tokens=max_gen), self.tokenizer)
        decoder.use_auxiliary(self.auxiliary)
        eos = generation_eos_ids(self.model) | special_stop_ids(self.tokenizer, until)
        show = not disable_tqdm and self.rank == 0
        with decoder.prepare(self.model):
            results = run_decoder(self.model, decoder, prompts, indices, eos, show, f"pardec {self.decoder_choice}")
        records = []
        for i, result in zip(members, results, strict=True):
            outputs[i] = hf_continuation(self.tokenizer, result.tokens, until)
            self.cache_hook.add_partial("generate_until", requests[i].args, outputs[i])
            if repeat[i] < (requests[i].repeats or 1):  # not one of lm-eval's padding copies
                records.append({
                    "task": requests[i].task_name, "index": index[i], "rank": self.rank, "output_ids": result.tokens,
                    "committed": result.committed, "forwards": result.forwards, "wall_time_s": result.wall_time_s,
                    "hit_eos": result.hit_eos, "correct": None, "reference_ids": None, "stats": result.stats,
                })
        return records

    def _prompt(self, context: str, index: int, max_context: int) -> list[int]:
        """Validation's plain-template prompt ids, left-truncated to ``max_context`` as lm-eval's HF model does."""
        ids = encode_prompt(self.tokenizer, context, "plain", self.cfg.add_bos, index)
        if len(ids) > max_context:
            logger.warning("left-truncating a %d-token context to %d, as lm-eval's HF does", len(ids), max_context)
        return ids[-max_context:]

    def _warn_ignored(self, kwargs: Mapping[str, Any]) -> None:
        asked = {k: v for k, v in kwargs.items() if k not in HONOURED_GEN_KWARGS}
        if not asked.get("do_sample") and asked.get("temperature", 0.0) == 0.0:
            asked = {k: v for k, v in asked.items() if k not in ("do_sample", "temperature")}  # greedy: nothing asked
        new = sorted(set(asked) - self.warned_gen_kwargs)
        if new:
            self.warned_gen_kwargs.update(new)
            logger.warning(
                "generation kwargs %s are ignored: decoder=%s decides how to decode (choose a sampling decoder, "
                "e.g. decoder=ar_sample,temperature=0.7)", {k: asked[k] for k in new}, self.decoder_choice,
            )

    # -- decoder stats ----------------------------------------------------------------------------

    def _add_stats(self, records: list[dict[str, Any]]) -> None:
        """Gather the records on rank 0, keep them per task and print the task's updated stats."""
        records = gather_records(records, self.dist)
        for record in records:
            self.records[record["task"]].append(record)
        if self.rank == 0:
            stats = self.decoder_stats()
            for task in sorted({r["task"] for r in records}):
                print(format_markdown(stats[task], title=f"pardec decoder {self.decoder_choice} on {task}"))

    def decoder_stats(self) -> dict[str, dict[str, Any]]:
        """Per task: validation's aggregates and the decoder's summary over every decoded request (rank 0)."""
        decoder = build_decoder(self.decoder_cfg, self.tokenizer)
        stats = {}
        for task, records in self.records.items():
            metrics = compute_metrics(records, decoder.is_ar_greedy)
            metrics = {k: v for k, v in metrics.items() if not k.startswith("accuracy")}  # the scores are lm-eval's
            stats[task] = {**metrics, **decoder.summarize(records)}
        return stats

    def get_model_info(self) -> dict[str, Any]:
        """lm-eval merges this into its results' ``config`` (rank 0, after the evaluation)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "pardec": {
                "checkpoint": self.cfg.checkpoint,
                "decoder_choice": self.decoder_choice,
                "decoder": asdict(self.decoder_cfg),
                "world_size": self.world_size,
                "decoder_stats": self.decoder_stats(),
            },
        }

    # -- likelihoods ------------------------------------------------------------------------------

    def _require_ar_head(self, request_type: str) -> None:
        if self.metadata.kind not in (AR, MASKED_AR):
            raise CheckpointError(
                f"{request_type} needs a next-token (AR) head, and {self.cfg.checkpoint} is a checkpoint of kind "
                f"{self.metadata.describe_kind()}: evaluate it on generation tasks (generate_until) only"
            )

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._require_ar_head("loglikelihood")
        return super().loglikelihood(requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self._require_ar_head("loglikelihood_rolling")
        return super().loglikelihood_rolling(requests, disable_tqdm)

    # -- lm-eval's collectives, on pardec's process group ------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        flat = tensor.reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return torch.cat(parts)

    def barrier(self) -> None:
        barrier()
