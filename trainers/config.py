"""Structured schema of the Hydra config tree in ``recipes/``.

Hydra composes YAML; :func:`validate_train_config` merges the result into these dataclasses, so a
mistyped or unknown key anywhere (``trainer.lrr=1``, ``+model.foo=1``) fails at start with the key's
full name. The ``recipe`` node is validated against the dataclass its ``name`` selects (see
``methods.registry``), so method-specific keys are checked too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.errors import ConfigError
from data_pipelines.config import DataConfig
from models.loading import check_attn_implementation


@dataclass
class ModelConfig:
    # A local Hugging Face checkpoint directory (AutoModelForCausalLM) ...
    path: Optional[str] = None
    # ... or a tiny random model from a transformers config: {model_type: qwen3, hidden_size: 64, ...}
    config: Optional[Dict[str, Any]] = None
    # Tokenizer directory; null = model.path; "synthetic" = the embedded default's tokenizer.
    tokenizer: Optional[str] = None
    # auto = flex_attention/flash_attention_2 on GPU when the method needs it, sdpa on CPU.
    attn_implementation: str = "auto"
    # auto = bf16 on GPU, fp32 on CPU.
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class TrainerConfig:
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # cosine | linear | constant, each after linear warmup
    schedule: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_steps: int = 100
    clip_grad: float = 1.0
    seed: int = 0
    log_every: int = 10
    save_every: int = 0
    export_every: int = 0
    keep_checkpoints: int = 2
    # auto: resume from output_dir/checkpoints if one exists; never; or a checkpoint directory.
    resume: str = "auto"
    # Stop (with a checkpoint) after this many optimiser steps in this process; for tests and
    # preemption drills. null = run to max_steps.
    stop_after_steps: Optional[int] = None
    num_workers: int = 0


@dataclass
class DeepSpeedConfig:
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 50_000_000
    stage3_gather_16bit_weights_on_model_save: bool = True
    # Extra keys merged verbatim into the generated DeepSpeed JSON (advanced).
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LoggingConfig:
    # wandb | none
    backend: str = "wandb"
    # offline by default; online needs WANDB_API_KEY and network.
    wandb_mode: str = "offline"
    project: str = "pardec"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    progress_bar: bool = True


@dataclass
class EvalConfig:
    # Evaluate every N optimiser steps (0 = only at the end when at_end).
    every: int = 0
    at_end: bool = True
    num_samples: int = 64
    decoder: str = "ar"
    max_new_tokens: int = 128
    batch_size: int = 16


@dataclass
class TrainConfig:
    recipe: Any = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    experiment_name: str = "default"
    output_dir: str = "runs/default"


def register_schema() -> None:
    """Make ``train_schema`` (the first default of recipes/train.yaml) known to Hydra."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)




def validate_train_config(cfg: DictConfig) -> DictConfig:
    """Merge the composed Hydra config into the schema; unknown/mistyped keys raise ConfigError."""
    from methods.registry import recipe_schema

    raw = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(raw, dict):
        raw.pop("hydra", None)
    recipe_raw = raw.pop("recipe", None) if isinstance(raw, dict) else None
    try:
        schema = OmegaConf.structured(TrainConfig)
        merged = OmegaConf.merge(schema, OmegaConf.create(raw))
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config: {_describe(err)}") from None
    if not isinstance(recipe_raw, dict) or "name" not in recipe_raw:
        raise ConfigError("config key 'recipe.name' is missing: choose a recipe, e.g. recipe=ar")
    try:
        recipe_node = OmegaConf.merge(OmegaConf.structured(recipe_schema(recipe_raw["name"])), recipe_raw)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config under 'recipe': {_describe(err)}") from None
    OmegaConf.set_struct(merged, False)
    merged.recipe = recipe_node
    OmegaConf.set_struct(merged, True)
    _check_values(merged)
    return merged


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = str(err).splitlines()[0]
    return f"key '{key}': {msg}" if key else msg


def _check_values(cfg: DictConfig) -> None:
    choices = {
        "data.source": ("synthetic", "files", "hub"),
        "data.template": ("plain", "chat"),
        "data.length_policy": ("truncate", "drop", "error"),
        "trainer.schedule": ("cosine", "linear", "constant"),
        "logging.backend": ("wandb", "none"),
        "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    }
    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}' = {value!r}; expected one of {allowed}")
    check_attn_implementation(cfg.model.attn_implementation, "model.attn_implementation")
    if cfg.deepspeed.stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'deepspeed.stage' = {cfg.deepspeed.stage}; expected 0, 1, 2 or 3")
    if cfg.model.path is None and cfg.model.config is None:
        raise ConfigError("set 'model.path' (a local HF checkpoint) or 'model.config' (a tiny model), e.g. model=tiny_qwen3")
    for key in ("trainer.micro_batch_size", "trainer.grad_accum", "trainer.max_steps", "data.max_length"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {OmegaConf.select(cfg, key)}")
