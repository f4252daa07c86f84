"""Load a model + tokenizer from a local Hugging Face checkpoint directory, with clear errors.

Checks, in order, each failing with :class:`CheckpointError` naming the offending path or value:
the directory exists; it has ``config.json`` and weights (``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin``[``.index.json``]); every safetensors
file has a readable header and a data section of the declared size (a truncated file is named);
it has tokenizer files (:data:`pardec.models.loading.TOKENIZER_FILES`: without them transformers builds
an empty tokenizer); the tokenizer loads; the tokenizer does not produce ids beyond the model's
embedding table; and a ``pardec.mask_token_id`` recorded in ``config.json`` is the tokenizer's
``<|mask|>`` id. The file checks are :func:`pardec.models.loading.check_checkpoint_files` and
:func:`pardec.models.loading.check_tokenizer_files`, the ones training runs on ``model.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from transformers import AutoModelForCausalLM, AutoTokenizer

from pardec.common.errors import CheckpointError
from pardec.common.metadata import CheckpointMetadata
from pardec.inference.decoders.registry import auxiliary_checkpoints
from pardec.models.loading import check_checkpoint_files, check_tokenizer_files, check_tokenizer_matches, resolve_dtype


def resolve_device(device: str) -> torch.device:
    """``auto`` = the local rank's GPU when CUDA is available, else CPU."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_checkpoint(
    path: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str = "auto",
):
    """``(model, tokenizer)`` from ``path``; the model is in eval mode on the resolved device."""
    path = Path(path)
    check_checkpoint_files(path)
    check_tokenizer_files(path)
    torch_device = resolve_device(device)
    kwargs = {"dtype": resolve_dtype(dtype, torch_device.type == "cuda", key="dtype")}
    if attn_implementation != "auto":
        kwargs["attn_implementation"] = attn_implementation
    metadata = CheckpointMetadata.read(path)  # validated: a bad record is named before loading weights
    try:
        if metadata.gated_lora_adapter:
            # R-ISD export: frozen base + gated LoRA (residual only on <|mask|> inputs).
            from pardec.models.gated_lora import load_gated_lora_export

            model = load_gated_lora_export(path, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"could not load the model from {path}: {err}") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"could not load the tokenizer from {path}: {err}") from err
    check_tokenizer_matches(model, tokenizer, where=str(path))
    if metadata.mask_token_id is not None:
        forbid_output_token(model, metadata.mask_token_id)
    return model.to(torch_device).eval(), tokenizer


def load_for_decoding(cfg) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, auxiliary)`` for a validation config (``pardec.inference.config.ValidateConfig``):
    ``cfg.checkpoint`` and the auxiliary models ``cfg.decoder`` names (loaded once, keyed by config field,
    for ``Decoder.use_auxiliary``), on ``cfg.device`` in ``cfg.dtype``."""
    model, tokenizer = load_checkpoint(cfg.checkpoint, cfg.device, cfg.dtype, cfg.attn_implementation)
    auxiliary = {
        field: load_checkpoint(path, cfg.device, cfg.dtype)[0]
        for field, path in auxiliary_checkpoints(cfg.decoder).items()
    }
    return model, tokenizer, auxiliary


def forbid_output_token(model, token_id: int) -> RemovableHandle:
    """Never let a decoder emit ``token_id`` (a converted model's ``<|mask|>``): its logit is set
    to -inf in every forward's output.

    ``<|mask|>`` is an input symbol only. With tied embeddings its randomly initialised row is also
    an output row, so without this the clean stream would put probability on a token the base
    never had. Excluding it makes the clean-stream distribution over the original vocabulary
    exactly the base's (R-ISD: lossless for greedy and sampling, whatever the row's draw), and
    drafts are never ``<|mask|>`` either.
    """

    def hook(module, args, output):
        output.logits[..., token_id] = float("-inf")
        return output

    return model.register_forward_hook(hook)
