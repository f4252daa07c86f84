"""Structured schema of ``pardec/recipes/validate.yaml`` (``pardec/cli/validate.py``).

``pardec/cli/validate.py`` registers :class:`ValidateConfig` in Hydra's ConfigStore as
``validate_schema``, the first default of ``pardec/recipes/validate.yaml``, so an unknown top-level or
``data.*`` key fails while composing (``data`` is the trainer's ``DataConfig``). After composing,
:func:`validate_validate_config` merges the result into the schema again (for configs built
without Hydra) and validates the ``decoder`` node against the config dataclass its ``name``
selects (``pardec.inference.decoders.registry``), so decoder-specific keys are checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pardec.common.config_fields import check_config, ranged
from pardec.common.errors import ConfigError
from pardec.data_pipelines.config import DataConfig
from pardec.inference.decoders.registry import decoder_config
from pardec.models.loading import DType, check_attn_implementation


@dataclass
class ValidateConfig:
    # Local Hugging Face checkpoint directory (model + tokenizer).
    checkpoint: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    # A decoder config from pardec/recipes/decoder/ (validated by the decoder registry).
    decoder: Any = None
    # Where metrics.json, metrics.md and samples.jsonl go; default <checkpoint>/eval/<decoder choice>.
    output_dir: Optional[str] = None
    # auto = the local rank's GPU if any, else cpu.
    device: str = "auto"
    # auto = bfloat16 on GPU, float32 on CPU.
    dtype: DType = DType.auto
    # auto = the checkpoint's default (sdpa); or eager, or any attention registered with transformers'
    # AttentionInterface (sdpa, flash_attention_2, flex_attention, a custom function, ...).
    attn_implementation: str = "auto"
    # Prefix plain-template prompts with the tokenizer's BOS (when it has one).
    add_bos: bool = False
    # Also decode with AR greedy to measure token agreement (skipped for AR greedy itself).
    agreement: bool = True
    reference_batch_size: int = ranged(1, ge=1)
    progress: bool = True


def validate_validate_config(cfg: DictConfig) -> DictConfig:
    """Merge the composed config into the schema; unknown or mistyped keys raise ConfigError."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("config key 'checkpoint' is required: checkpoint=<local HF checkpoint directory>")
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    decoder_raw = raw.pop("decoder", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ValidateConfig), OmegaConf.create(raw))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"invalid config: key '{key}': {str(err).splitlines()[0]}") from None
    if not isinstance(decoder_raw, dict):
        raise ConfigError("config key 'decoder' is missing: choose a decoder, e.g. decoder=ar_greedy")
    OmegaConf.set_struct(merged, False)
    merged.decoder = OmegaConf.structured(decoder_config(decoder_raw))
    OmegaConf.set_struct(merged, True)
    check_config(merged)
    check_attn_implementation(merged.attn_implementation, "attn_implementation")
    return merged
