"""Load the base model and tokenizer for training; add ``<|mask|>``; pick the attention backend.

A model comes either from a local Hugging Face checkpoint (``model.path``) or from a transformers
config (``model.config``, a dict with ``model_type``) for tiny random models. The tokenizer comes
from ``model.tokenizer``, else ``model.path``; ``synthetic`` builds the embedded default's tokenizer
(offline, deterministic).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from common.constants import MASK_TOKEN, METADATA_KEY
from common.errors import CheckpointError, ConfigError
from common.metadata import CheckpointMetadata

log = logging.getLogger(__name__)



DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, on_gpu: bool, key: str = "model.dtype") -> torch.dtype:
    """``auto`` = bfloat16 on GPU, float32 on CPU; else one of :data:`DTYPES` (``key`` names the
    config key in the error)."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"config key '{key}' = {name!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_attn_implementation(name: str, on_gpu: bool, needs_custom_mask: bool) -> str:
    """``auto``: flex_attention for structured masks on GPU, flash-attn for plain causal on GPU
    when installed, sdpa otherwise (CPU). An explicit choice is checked against what is available."""
    if name == "auto":
        if not on_gpu:
            return "sdpa"
        if needs_custom_mask:
            return "flex_attention"
        return "flash_attention_2" if _has_flash_attn() else "sdpa"
    if name == "flash_attention_2" and not (on_gpu and _has_flash_attn()):
        raise ConfigError("model.attn_implementation=flash_attention_2 needs a CUDA GPU and the 'gpu' extra (flash-attn)")
    if name == "flex_attention" and not on_gpu:
        raise ConfigError(
            "model.attn_implementation=flex_attention needs a CUDA GPU (FlexAttention has no CPU backward); use sdpa on CPU"
        )
    return name


def check_attn_implementation(name: str, key: str) -> None:
    """``auto``, ``eager`` or an attention function registered with transformers'
    ``AttentionInterface`` (the built-ins sdpa, flex_attention, flash_attention_2, ... and any
    function a project registers, e.g. a decoder's KV-override attention); the registry is asked,
    not a list. :class:`ConfigError` naming ``key`` otherwise."""
    registered = sorted(AttentionInterface().keys())
    if name not in ("auto", "eager") and name not in registered:
        raise ConfigError(f"config key '{key}' = {name!r}; expected auto, eager or a registered attention: {registered}")


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def load_tokenizer(model_cfg, data_cfg) -> PreTrainedTokenizerBase:
    source = model_cfg.tokenizer or model_cfg.path
    if source == "synthetic":
        from data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer

        return build_synthetic_tokenizer(data_cfg.synthetic)
    if source is None:
        raise ConfigError("config key 'model.tokenizer' is required with model.config (e.g. model.tokenizer=synthetic)")
    if not Path(source).is_dir():
        raise ConfigError(f"tokenizer directory not found: {source} (config key 'model.tokenizer' or 'model.path')")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer at {source} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_cfg, tokenizer, dtype: torch.dtype, attn_implementation: str):
    if model_cfg.path is not None:
        path = Path(model_cfg.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={model_cfg.path}: no config.json there (expected a local HF checkpoint directory)")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=model_cfg.trust_remote_code
        )
    else:
        kwargs = dict(model_cfg.config)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ConfigError("config key 'model.config.model_type' is required for a model built from a config")
        kwargs.setdefault("vocab_size", len(tokenizer))
        kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
        kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
        kwargs.setdefault("bos_token_id", tokenizer.bos_token_id)
        config = AutoConfig.for_model(model_type, **kwargs)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    check_tokenizer_matches(model, tokenizer, where=model_cfg.path or "model.config")
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def check_tokenizer_matches(model, tokenizer, where: str) -> None:
    """The tokenizer's ids fit the model's embedding, and a recorded ``mask_token_id`` is the
    tokenizer's ``<|mask|>`` id; :class:`CheckpointError` naming ``where`` otherwise."""
    n_embed = model.get_input_embeddings().num_embeddings  # not weight.shape: empty under ZeRO-3
    if len(tokenizer) > n_embed:
        raise CheckpointError(
            f"tokenizer/model mismatch at {where}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"embedding has {n_embed} rows"
        )
    recorded = CheckpointMetadata.of_model(model).mask_token_id
    if recorded is None:
        return
    token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != MASK_TOKEN:
        raise CheckpointError(
            f"config.json of {where} records {METADATA_KEY}.mask_token_id={recorded} but the tokenizer has no "
            f"{MASK_TOKEN} token"
        )
    if token_id != recorded:
        raise CheckpointError(
            f"config.json of {where} records {METADATA_KEY}.mask_token_id={recorded} but the tokenizer's "
            f"{MASK_TOKEN} id is {token_id}"
        )


def add_mask_token(model, tokenizer) -> int:
    """Add ``<|mask|>`` (resizing embeddings only if the id falls outside them) and record its id
    in the model's :class:`CheckpointMetadata` so decoders never guess it. Returns the id."""
    if MASK_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if mask_id >= model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    CheckpointMetadata.of_model(model).updated(mask_token_id=mask_id).write_to(model)
    return mask_id


def mask_token_id(model, tokenizer=None) -> int:
    """The recorded ``<|mask|>`` id; errors if missing, or inconsistent with ``tokenizer`` when given."""
    recorded = CheckpointMetadata.of_model(model).mask_token_id
    if recorded is None:
        raise ConfigError(
            f"checkpoint has no '{METADATA_KEY}.mask_token_id' in its config.json: it was not converted with a "
            f"recipe that adds {MASK_TOKEN} (e.g. recipe=idlm)"
        )
    if tokenizer is not None:
        tok_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if tok_id != recorded or tok_id == tokenizer.unk_token_id:
            raise ConfigError(f"mask token mismatch: config records {recorded}, tokenizer maps {MASK_TOKEN} to {tok_id}")
    return recorded
