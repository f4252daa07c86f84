"""Structured schema of the Hydra config tree in ``pardec/recipes/``.

Hydra composes YAML; :func:`validate_train_config` merges the result into these dataclasses, so a
mistyped or unknown key anywhere (``trainer.lrr=1``, ``+model.foo=1``) fails at start with the key's
full name. The ``recipe`` node is validated against the dataclass its ``name`` selects (see
``pardec.methods.registry``), so method-specific keys are checked too.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pardec.common.config_fields import Choice, check_config, ranged
from pardec.common.errors import ConfigError
from pardec.data_pipelines.config import DataConfig
from pardec.models.loading import DType, check_attn_implementation
from pardec.models.lora import PROJECTIONS
from pardec.trainers.checkpoint import OnExisting

log = logging.getLogger(__name__)


@dataclass
class LoraTrainingConfig:
    # null = train every weight; r = a plain LoRA of rank r on target_modules, every other weight
    # (the <|mask|> row included) frozen, merged into the export (pardec.models.lora).
    rank: Optional[int] = ranged(None, ge=1, note="null = full fine-tuning")
    # LoRA alpha (the residual's scale is alpha / rank); null = rank (scale 1).
    alpha: Optional[float] = ranged(None, gt=0)
    dropout: float = ranged(0.0, ge=0, lt=1)
    # Linear layers that get the LoRA (PEFT target_modules: name suffixes).
    target_modules: List[str] = field(default_factory=lambda: list(PROJECTIONS))


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
    dtype: DType = DType.auto
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    # attn_implementation=pardec_flex only: FlexAttention kernel_options (e.g. {BLOCK_M: 128, BLOCK_N: 64})
    # and torch.compile mode (e.g. max-autotune-no-cudagraphs); null = torch's defaults for the GPU.
    # pardec/benchmarks/flex_kernels.py measures the choices. (Any, not Dict: OmegaConf cannot merge a
    # command-line dict into a None-valued typed Dict; pardec.models.loading checks it is a mapping.)
    flex_kernel_options: Optional[Any] = None
    flex_compile_mode: Optional[str] = None
    # attn_implementation=pardec_flex, grouped-query models: copy K/V to every query head before the
    # kernel instead of grouping heads inside it (pardec.models.flex_attention.configure says why it can pay).
    flex_repeat_kv: bool = False
    # LoRA training instead of full fine-tuning (docs/guide/configuration.md#lora-training).
    lora: LoraTrainingConfig = field(default_factory=LoraTrainingConfig)


class LRSchedule(Choice):
    """``trainer.schedule``, each after linear warmup (``pardec.trainers.schedule``)."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class TrainerConfig:
    micro_batch_size: int = ranged(8, ge=1)
    grad_accum: int = ranged(1, ge=1)
    lr: float = ranged(3e-4, gt=0)
    # The learning rate decays to min_lr_ratio * lr.
    min_lr_ratio: float = ranged(0.0, ge=0, le=1)
    weight_decay: float = ranged(0.0, ge=0)
    betas: List[float] = ranged(default_factory=lambda: [0.9, 0.95], ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    schedule: LRSchedule = LRSchedule.cosine
    warmup_steps: int = ranged(0, ge=0)
    warmup_ratio: float = ranged(0.0, ge=0, le=1)
    max_steps: int = ranged(100, ge=1)
    # Gradient-norm clipping (DeepSpeed's gradient_clipping); 0 = off.
    clip_grad: float = ranged(1.0, ge=0, note="0 = off")
    seed: int = ranged(0, ge=0)
    log_every: int = ranged(10, ge=1)
    # Checkpoint / export (hf-step-*) every N optimiser steps; 0 = off (the final ones are always written).
    save_every: int = ranged(0, ge=0, note="0 = off")
    export_every: int = ranged(0, ge=0, note="0 = off")
    # Checkpoints kept by pruning; 0 = keep every one.
    keep_checkpoints: int = ranged(2, ge=0, note="0 = keep all")
    # auto: resume from output_dir/checkpoints if one exists; never; or a checkpoint directory.
    resume: str = "auto"
    # A fresh start (resume=never, or auto with nothing to resume) in an output_dir holding a
    # previous run's checkpoints/exports: refuse (naming them) | archive (move them to
    # output_dir/archive/<time>/) | delete.
    on_existing: OnExisting = OnExisting.refuse
    # Stop (with a checkpoint) after this many optimiser steps in this process; for tests and
    # preemption drills. null = run to max_steps.
    stop_after_steps: Optional[int] = ranged(None, ge=1)
    # Resume even though the training data or tokenizer differ from what the checkpoint records
    # (pardec.trainers.fingerprint): the change is logged. false = such a resume is refused.
    allow_data_change: bool = False


@dataclass
class DeepSpeedConfig:
    # ZeRO stage; 0 = plain data parallel.
    stage: int = ranged(0, ge=0, le=3)
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = ranged(50_000_000, ge=1)
    stage3_gather_16bit_weights_on_model_save: bool = True
    # Extra keys merged verbatim into the generated DeepSpeed JSON (advanced).
    extra: Dict[str, Any] = field(default_factory=dict)


class LoggingBackend(Choice):
    wandb = "wandb"
    none = "none"


@dataclass
class LoggingConfig:
    backend: LoggingBackend = LoggingBackend.wandb
    # offline by default; online needs WANDB_API_KEY and network.
    wandb_mode: str = "offline"
    project: str = "pardec"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    progress_bar: bool = True


@dataclass
class EvalConfig:
    # Evaluate every N optimiser steps (0 = only at the end when at_end).
    every: int = ranged(0, ge=0, note="0 = only at the end")
    at_end: bool = True
    num_samples: int = ranged(64, ge=1)
    decoder: str = "ar"
    max_new_tokens: int = ranged(128, ge=1)
    batch_size: int = ranged(16, ge=1)


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
    """Make ``train_schema`` (the first default of pardec/recipes/train.yaml) known to Hydra."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)




def validate_train_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """Merge the composed Hydra config into the schema; unknown/mistyped keys raise ConfigError.
    ``overrides``: the command line's (Hydra's task overrides), for :func:`_check_stage_shadowing`."""
    from pardec.methods.registry import recipe_schema

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
        raise ConfigError(f"invalid config: {_describe(err, 'recipe.')}") from None
    OmegaConf.set_struct(merged, False)
    merged.recipe = recipe_node
    OmegaConf.set_struct(merged, True)
    check_config(merged)
    _check_values(merged)
    _check_stages(merged)
    _check_stage_shadowing(merged, overrides)
    _check_model_config(merged)
    _check_eval_decoder(merged)
    from pardec.trainers.deepspeed_config import check_deepspeed_config

    check_deepspeed_config(merged)
    return merged


def _describe(err: OmegaConfBaseException, prefix: str = "") -> str:
    key = getattr(err, "full_key", None)
    msg = str(err).splitlines()[0]
    return f"key '{prefix}{key}': {msg}" if key else msg


def _check_values(cfg: DictConfig) -> None:
    """What the field types and ranges (``check_config``) cannot say."""
    check_attn_implementation(cfg.model.attn_implementation, "model.attn_implementation")
    if cfg.model.path is None and cfg.model.config is None:
        raise ConfigError("set 'model.path' (a local HF checkpoint) or 'model.config' (a tiny model), "
                          "e.g. model=tiny_qwen3")
    if cfg.model.lora.rank is not None and cfg.recipe.name == "idlm_lora":
        raise ConfigError(f"config key 'model.lora.rank' = {cfg.model.lora.rank} with recipe=idlm_lora: that recipe "
                          "trains its own gated LoRA (recipe.lora_rank); set model.lora.rank=null")
    if cfg.model.lora.rank is not None and not cfg.model.lora.target_modules:
        raise ConfigError("config key 'model.lora.target_modules' is empty: name the linear layers the LoRA goes on, "
                          f"e.g. {list(PROJECTIONS)}")
    if len(cfg.trainer.betas) != 2:
        raise ConfigError(f"config key 'trainer.betas' = {list(cfg.trainer.betas)}; expected two values in [0, 1), "
                          "e.g. [0.9, 0.95]")


STAGE_KEYS = ("name", "max_steps", "overrides")


def _check_stages(cfg: DictConfig) -> None:
    """Each ``recipe.stages`` entry: known keys, ``max_steps`` >= 1, overrides that exist and type-check."""
    for i, stage in enumerate(cfg.recipe.get("stages") or []):
        where = f"recipe.stages[{i}]"
        if not isinstance(stage, (dict, DictConfig)):
            raise ConfigError(f"{where} must be a mapping {{name, max_steps, overrides}}, got {stage!r}")
        unknown = set(stage) - set(STAGE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (allowed: {', '.join(STAGE_KEYS)})")
        if "max_steps" in stage and (not isinstance(stage["max_steps"], int) or stage["max_steps"] < 1):
            raise ConfigError(f"config key '{where}.max_steps' must be an integer >= 1, got {stage['max_steps']!r} "
                              f"(a stage with no steps would export an untrained model as finished)")
        recipe = cfg.recipe.copy()
        OmegaConf.set_struct(recipe, True)
        for key, value in (stage.get("overrides") or {}).items():
            if OmegaConf.select(recipe, key, default="__missing__") == "__missing__" or key == "stages":
                raise ConfigError(f"{where}: override key 'recipe.{key}' does not exist")
            try:
                OmegaConf.update(recipe, key, value, merge=True)
            except OmegaConfBaseException as err:
                raise ConfigError(f"config key '{where}.overrides.{key}': {_describe(err)}") from None
        try:
            check_config(recipe, "recipe")
        except ConfigError as err:
            raise ConfigError(f"{where} ({stage.get('name', i)!r}): {err}") from None


def _check_stage_shadowing(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A setting given on the command line that ``recipe.stages`` override (``trainer.max_steps`` by a
    stage's ``max_steps``, ``recipe.<key>`` by its ``overrides``) is refused when every stage overrides
    it, since it would apply nowhere (``recipe=idlm trainer.max_steps=2`` trained the stages' 800 steps),
    and announced (logged) when only some do: it is then the value of the other stages, a deliberate
    use. Refused rather than announced in the first case because nothing of it would take effect and the
    mistake costs a whole run; only command-line settings count, as the composed config cannot tell a
    default (train.yaml's trainer.max_steps) from a choice."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    stages = list(cfg.recipe.get("stages") or [])
    if not stages or not overrides:
        return
    given = sorted({o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))
                    if not o.is_delete()})
    for key in given:
        if key == "trainer.max_steps":
            by = {i: f"recipe.stages[{i}].max_steps = {st['max_steps']}" for i, st in enumerate(stages)
                  if "max_steps" in st}
        elif key.startswith("recipe.") and key.split(".")[1] != "stages":
            sub = key[len("recipe."):]
            by = {i: f"recipe.stages[{i}].overrides.{k} = {v}" for i, st in enumerate(stages)
                  for k, v in (st.get("overrides") or {}).items()
                  if k == sub or sub.startswith(k + ".") or k.startswith(sub + ".")}
        else:
            continue
        if not by:
            continue
        value = OmegaConf.select(cfg, key)
        if len(by) == len(stages):
            raise ConfigError(
                f"config key '{key}' = {value} (given on the command line) is replaced in every stage of recipe="
                f"{cfg.recipe.name}: " + ", ".join(by.values()) + f"; it would apply nowhere. Set the stages' own "
                f"values instead (recipe.stages=[...]) or drop {key}")
        names = [stages[i].get("name", f"stage{i}") for i in range(len(stages)) if i not in by]
        log.info("config key '%s' = %s applies to stage(s) %s; %s replace(s) it in the others", key, value,
                 ", ".join(names), ", ".join(by.values()))


def _check_model_config(cfg: DictConfig) -> None:
    """``model.config`` keys must be attributes the transformers config class knows: a key it would
    only store verbatim (a typo such as ``hiden_size``) is refused instead of reaching config.json."""
    if cfg.model.config is not None and len(cfg.model.config) == 0:
        cfg.model.config = None  # {} (model/hf.yaml: room for a +model.config.<key> override to be named) = unset
    if cfg.model.config is None:
        return
    if cfg.model.path is not None:
        keys = ", ".join(f"'model.config.{k}'" for k in sorted(_flatten(OmegaConf.to_container(cfg.model.config))))
        raise ConfigError(
            f"config key(s) {keys} set with model.path={cfg.model.path}: a Hugging Face model's config comes from its "
            f"checkpoint ({cfg.model.path}/config.json), so model.config would be ignored; model.config builds a small "
            "random model instead (with model.path=null, e.g. model=tiny_qwen3). Drop the model.config override")
    raw = OmegaConf.to_container(cfg.model.config, resolve=True)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ConfigError("config key 'model.config.model_type' is required for a model built from a config")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        raise ConfigError(f"config key 'model.config.model_type' = {model_type!r} is not a transformers model type"
                          + (f" (did you mean {', '.join(close)}?)" if close else ""))
    default_keys = set(AutoConfig.for_model(model_type).to_dict())
    try:
        built = AutoConfig.for_model(model_type, **raw).to_dict()
    except Exception as err:  # noqa: BLE001 (transformers validates values with several exception types)
        raise ConfigError(f"config key 'model.config': transformers rejects it: {type(err).__name__}: {err}") from None
    unknown = sorted(k for k in raw if k in built and k not in default_keys)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(default_keys), n=3)
        raise ConfigError(f"config key 'model.config.{key}' is not a {model_type} config attribute (it would be "
                          f"ignored by the model)" + (f"; did you mean {', '.join(close)}?" if close else ""))


def _check_eval_decoder(cfg: DictConfig) -> None:
    """Validate the in-training evaluation decoder now, not after training and export."""
    from pardec.inference.decoders.registry import decoder_config

    raw = {"name": cfg.eval.decoder, "max_new_tokens": cfg.eval.max_new_tokens, "batch_size": cfg.eval.batch_size}
    try:
        decoder_config(raw)
    except ConfigError as err:
        detail = str(err).split("; ", 1)[-1]  # the registry names its own key (decoder.name)
        raise ConfigError(f"config key 'eval.decoder' = {cfg.eval.decoder!r}: {detail}") from None


# Keys a resume may change: they do not alter the trained state or the data order. Everything else
# differing from the checkpoint's config.yaml refuses the resume (see ``resume_changes``).
# trainer.max_steps is applied: the schedule is recomputed over the new length from the current step.
SAFE_TO_CHANGE_ON_RESUME = (
    "trainer.max_steps",
    "trainer.stop_after_steps",
    "trainer.resume",
    "trainer.on_existing",
    "trainer.log_every",
    "trainer.save_every",
    "trainer.export_every",
    "trainer.keep_checkpoints",
    "trainer.num_workers",  # removed (it never did anything); listed so that runs saved with it resume
    "trainer.allow_data_change",  # the data check itself (pardec.trainers.fingerprint)
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "model.flex_kernel_options",
    "model.flex_compile_mode",
    "model.flex_repeat_kv",
    "deepspeed.overlap_comm",
    "deepspeed.contiguous_gradients",
    "deepspeed.reduce_bucket_size",
    "logging.",
    "eval.",
    "output_dir",
    "experiment_name",
    "recipe.stages",  # each stage's effect is compared through its expanded config (max_steps, recipe keys)
)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _is_safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) or key.startswith(s + ".")
               for s in SAFE_TO_CHANGE_ON_RESUME)


def resume_changes(saved: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(applied, refused): ``"key: old -> new"`` for every key that differs between the config a
    checkpoint was written with and the config resuming it."""
    a, b = _flatten(saved), _flatten(new)
    defaults = _flatten(OmegaConf.to_container(OmegaConf.structured(TrainConfig), enum_to_str=True))
    applied, refused = [], []
    for key in sorted(set(a) | set(b)):
        old, cur = a.get(key, "<unset>"), b.get(key, "<unset>")
        if old == "<unset>" and key in defaults and cur == defaults[key]:
            continue  # a key added to pardec after the run was saved, at its default (the old behaviour)
        if old != cur:
            (applied if _is_safe(key) else refused).append(f"{key}: {old!r} -> {cur!r}")
    return applied, refused


def check_resume_config(saved_file: Path, cfg: DictConfig, what: str) -> list[str]:
    """Refuse to resume ``what`` when settings that shape the trained state changed (ConfigError
    listing them); return the safe changes that will be applied, for the log."""
    if not saved_file.is_file():
        return [f"{saved_file} is missing (written before configs were saved): settings not compared"]
    saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=True)
    applied, refused = resume_changes(saved, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    if refused:
        raise ConfigError(
            f"resuming {what} with changed settings ({saved_file} records what it was trained with): "
            + "; ".join(refused) + ". Restore them to continue, or start a new run (another output_dir, or "
            "trainer.resume=never with trainer.on_existing=archive). Keys that may change on resume: "
            + ", ".join(k + "*" if k.endswith(".") else k for k in SAFE_TO_CHANGE_ON_RESUME))
    return [f"changed on resume of {what} (applied): " + "; ".join(applied)] if applied else []
