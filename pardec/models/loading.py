"""Load the base model and tokenizer for training; add ``<|mask|>``; pick the attention backend.

A model comes either from a local Hugging Face checkpoint (``model.path``) or from a transformers
config (``model.config``, a dict with ``model_type``) for tiny random models. The tokenizer comes
from ``model.tokenizer``, else ``model.path``; ``synthetic`` builds the embedded default's tokenizer
(offline, deterministic).

Checked before anything is loaded, each failing with an error naming the key and the file: a
checkpoint directory's files (:func:`check_checkpoint_files`: config, weights, a truncated
safetensors file) and tokenizer files (:func:`check_tokenizer_files`), used by training
(``model.path``) and by ``pardec.inference.checkpoint`` alike; and the positions a method's samples use
against the base model's ``max_position_embeddings`` (:func:`check_max_positions`, at the start of
training, from the model's config alone).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from pardec.common.attention import COMPILED_FLEX_BACKEND, FLEX_BACKENDS
from pardec.common.config_fields import Choice
from pardec.common.constants import MASK_TOKEN, METADATA_KEY
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.models import flex_attention

flex_attention.register()

log = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)
# A tokenizer directory needs its vocabulary in one of these files (or a ``*.tiktoken`` file);
# without one, transformers 5 builds an empty tokenizer from config.json alone, which encodes
# every text to no ids at all.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


class DType(Choice):
    """``model.dtype`` / validation's ``dtype``: auto = bfloat16 on GPU, float32 on CPU."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}


def resolve_dtype(name: str, on_gpu: bool, key: str = "model.dtype") -> torch.dtype:
    """``auto`` = bfloat16 on GPU, float32 on CPU; else one of :data:`DTYPES` (``key`` names the
    config key in the error)."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"config key '{key}' = {name!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_attn_implementation(name: str, on_gpu: bool, needs_custom_mask: bool) -> str:
    """``auto``: pardec's FlexAttention (``pardec/models/flex_attention.py``) for structured masks on GPU,
    flash-attn for plain causal on GPU when installed, sdpa otherwise (CPU). An explicit choice is
    checked against what is available."""
    if name == "auto":
        if not on_gpu:
            return "sdpa"
        if needs_custom_mask:
            return COMPILED_FLEX_BACKEND
        return "flash_attention_2" if _has_flash_attn() else "sdpa"
    if name == "flash_attention_2" and not (on_gpu and _has_flash_attn()):
        raise ConfigError("model.attn_implementation=flash_attention_2 needs a CUDA GPU and the 'gpu' extra "
                          "(flash-attn)")
    if name in FLEX_BACKENDS and not on_gpu:
        raise ConfigError(
            f"model.attn_implementation={name} needs a CUDA GPU (FlexAttention has no CPU backward); use sdpa on CPU"
        )
    return name


def configure_flex_attention(model_cfg, attn_implementation: str) -> None:
    """``model.flex_kernel_options`` / ``model.flex_compile_mode`` / ``model.flex_repeat_kv`` into
    ``pardec.models.flex_attention``; they only mean something for ``attn_implementation=pardec_flex``
    (:class:`ConfigError` naming the key otherwise)."""
    options, mode, repeat_kv = model_cfg.flex_kernel_options, model_cfg.flex_compile_mode, model_cfg.flex_repeat_kv
    for key, value in (("model.flex_kernel_options", options), ("model.flex_compile_mode", mode),
                       ("model.flex_repeat_kv", repeat_kv or None)):
        if value is not None and attn_implementation != COMPILED_FLEX_BACKEND:
            raise ConfigError(f"config key '{key}' = {value!r} needs attn_implementation={COMPILED_FLEX_BACKEND}; "
                              f"this run uses {attn_implementation!r}")
    options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else options
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"config key 'model.flex_kernel_options' = {options!r}; expected a mapping such as "
                          "{BLOCK_M:64,BLOCK_N:64} or null")
    flex_attention.configure(options, mode, repeat_kv)


def check_attn_implementation(name: str, key: str) -> None:
    """``auto``, ``eager`` or an attention function registered with transformers'
    ``AttentionInterface`` (the built-ins sdpa, flex_attention, flash_attention_2, ... and any
    function a project registers, e.g. a decoder's KV-override attention); the registry is asked,
    not a list. :class:`ConfigError` naming ``key`` otherwise."""
    registered = sorted(AttentionInterface().keys())
    if name not in ("auto", "eager") and name not in registered:
        raise ConfigError(f"config key '{key}' = {name!r}; expected auto, eager or a registered attention: "
                          f"{registered}")


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def load_tokenizer(model_cfg, data_cfg) -> PreTrainedTokenizerBase:
    """The run's tokenizer (``model.tokenizer``, else ``model.path``, or ``synthetic``).

    Padding: a tokenizer's own pad token is kept; one without gets its EOS as pad, said in the log.
    Either is safe, also when pad and EOS are one id (SmolLM2's ``<|im_end|>``): every batch builder
    marks padding by position (segment id -1, ignored labels), never by token id, so EOS targets
    are trained and a pad never reaches a loss."""
    source = model_cfg.tokenizer or model_cfg.path
    if source == "synthetic":
        from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer

        return build_synthetic_tokenizer(data_cfg.synthetic)
    if source is None:
        raise ConfigError("config key 'model.tokenizer' is required with model.config (e.g. model.tokenizer=synthetic)")
    if not Path(source).is_dir():
        raise ConfigError(f"tokenizer directory not found: {source} (config key 'model.tokenizer' or 'model.path')")
    check_tokenizer_files(Path(source), "model.tokenizer" if model_cfg.tokenizer else "model.path")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"tokenizer at {source} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer at %s has no pad token: padding with its EOS %r (padding is masked by position)",
                 source, tokenizer.eos_token)
    return tokenizer


def load_model(model_cfg, tokenizer, dtype: torch.dtype, attn_implementation: str):
    if model_cfg.path is not None:
        path = Path(model_cfg.path)
        check_checkpoint_files(path, "model.path")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation,
                trust_remote_code=model_cfg.trust_remote_code
            )
        except (OSError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"model.path={path}: could not load the model: {err}") from err
    else:
        kwargs = _config_kwargs(model_cfg)
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


def max_positions(model_cfg) -> tuple[int | None, str]:
    """The base model's position limit, read from its config alone (no weights are loaded), and
    where it comes from. The limit is ``max_position_embeddings``; with a RoPE scaling of a type
    other than ``default`` (YaRN, linear, dynamic, ...) it is ``factor`` times the original
    length, which is what the scaling is configured for. ``None`` when the config has no limit."""
    if model_cfg.path is not None:
        path = Path(model_cfg.path)
        check_checkpoint_files(path, "model.path")  # at start: a truncated model.path is named here
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"model.path={path}: could not read {path / 'config.json'}: {err}") from err
        where = f"max_position_embeddings of {path / 'config.json'}"
    else:
        kwargs = _config_kwargs(model_cfg)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ConfigError("config key 'model.config.model_type' is required for a model built from a config")
        config = AutoConfig.for_model(model_type, **kwargs)
        where = "model.config.max_position_embeddings"
        if "max_position_embeddings" not in kwargs:
            where += f" ({model_type} default)"
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (None, "default")
    if limit is not None and scaled:
        factor = rope.get("factor")
        if factor:
            limit = max(limit, int(factor * rope.get("original_max_position_embeddings", limit)))
            where += f" x rope factor {factor}"
    return limit, where


def check_max_positions(model_cfg, positions: int, source: str) -> None:
    """Refuse at start a run whose samples would use position ids at or beyond the base model's
    limit (:func:`max_positions`): such positions were never trained and train silently otherwise.
    ``positions``: the most positions one training sample can use (largest position id + 1), set by
    the config keys ``source`` names (see ``pardec.methods.base.Method.max_positions``)."""
    limit, where = max_positions(model_cfg)
    if limit is None:
        log.warning("the model config has no max_position_embeddings: sample lengths are not checked against it")
        return
    if positions > limit:
        raise ConfigError(
            f"{source} lets a training sample use position ids up to {positions - 1}, but {where} = {limit}: "
            "lower data.max_length (or the method's lengths) to fit the base model's positions"
        )


def _config_kwargs(model_cfg) -> dict:
    """``model.config`` as plain Python (nested values such as ``rope_scaling`` included:
    transformers' config classes reject an OmegaConf node)."""
    config = model_cfg.config
    return OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config)


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
    if (
        token_id is None
        or token_id == tokenizer.unk_token_id
        or tokenizer.convert_ids_to_tokens(token_id) != MASK_TOKEN
    ):
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
    in the model's :class:`CheckpointMetadata` so decoders never guess it. Returns the id.

    The new row is transformers' mean resizing: drawn from a normal with the mean and covariance
    of the existing embedding rows, so the mask token starts as a typical input embedding rather
    than a zero or an outlier that would dominate the first steps. ``resize_token_embeddings``
    re-ties a tied output head (Llama/SmolLM2/Qwen3 small models), so the output row is the same
    tensor. The mask token is never a training target, and decoding never outputs it
    (``pardec.inference.checkpoint.forbid_output_token``, ``pardec.inference.decoders.base.forbid_mask``).
    ``tests/test_real_tokenizer.py`` checks the resize, the tie, the untouched old rows and the
    recorded id through export and reload."""
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
            raise ConfigError(f"mask token mismatch: config records {recorded}, tokenizer maps {MASK_TOKEN} to "
                              f"{tok_id}")
    return recorded


def check_checkpoint_files(path: Path, key: str | None = None) -> None:
    """A Hugging Face checkpoint directory has ``config.json`` and weights (``model.safetensors``, a
    sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``[``.index.json``]), and every
    safetensors file has a readable header with tensors (a truncated file is named). The one file
    check of training (``model.path``) and validation (``pardec.inference.checkpoint``);
    :class:`CheckpointError` naming the file, prefixed with the config ``key`` when given."""
    prefix = f"{key}={path}: " if key else ""
    if not path.is_dir():
        raise CheckpointError(f"{prefix}checkpoint directory not found: {path}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{prefix}no config.json in checkpoint directory {path}")
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        raise CheckpointError(f"{prefix}no model weights in {path}: expected one of {list(WEIGHT_FILES)}")
    for file in _safetensors_files(path, present, prefix):
        _check_safetensors(file, prefix)


def check_tokenizer_files(path: Path, key: str | None = None) -> None:
    """``path`` holds a tokenizer vocabulary (one of :data:`TOKENIZER_FILES` or a ``*.tiktoken``
    file); :class:`CheckpointError` naming the directory and the files expected otherwise (a model
    export without its tokenizer would otherwise load as an empty tokenizer)."""
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    prefix = f"{key}={path}: " if key else ""
    raise CheckpointError(
        f"{prefix}no tokenizer files in {path}: expected one of {list(TOKENIZER_FILES)} (or a *.tiktoken file); "
        "save the tokenizer there (tokenizer.save_pretrained) or point to a tokenizer directory"
    )


def _safetensors_files(path: Path, present: list[str], prefix: str) -> list[Path]:
    if "model.safetensors" in present:
        return [path / "model.safetensors"]
    if "model.safetensors.index.json" in present:
        index = path / "model.safetensors.index.json"
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{prefix}corrupt weight index {index}: {err}") from err
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{prefix}weight shards listed in {index} are missing: {missing}")
        return [path / s for s in shards]
    return []


def _check_safetensors(file: Path, prefix: str) -> None:
    """Open the header and check the data section is as long as the tensors it declares."""
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except Exception as err:  # safetensors raises its own SafetensorError, not exported stably
        raise CheckpointError(f"{prefix}corrupt or truncated weights file {file}: {err}") from err
    if not keys:
        raise CheckpointError(f"{prefix}weights file {file} contains no tensors (an empty export?)")
