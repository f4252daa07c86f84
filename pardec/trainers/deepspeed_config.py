"""The DeepSpeed JSON, derived from the trainer config: batch keys are computed, never typed twice.

``deepspeed.extra`` adds advanced DeepSpeed keys. It may not set what the trainer derives (batch
sizes, accumulation, clipping, precision, optimizer, scheduler, ZeRO stage and offload: each has a
trainer key, named in the refusal), and every key must be one DeepSpeed's own config parser reads
(checked at start by running ``deepspeed.runtime.config.DeepSpeedConfig`` on the result), so a
typo such as ``train_batch_sizee`` fails instead of being written to the JSON and ignored.
``extra.zero_optimization`` is merged into the derived ZeRO section key by key.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch
from omegaconf import OmegaConf

from pardec.common.errors import ConfigError

# DeepSpeed key -> the trainer key that sets it.
DERIVED = {
    "train_batch_size": "trainer.micro_batch_size and trainer.grad_accum (times the world size)",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "gradient_accumulation_steps": "trainer.grad_accum",
    "gradient_clipping": "trainer.clip_grad",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "amp": "model.dtype",
    "torch_autocast": "model.dtype",
    "optimizer": "trainer.lr, trainer.betas, trainer.eps and trainer.weight_decay (the trainer builds AdamW)",
    "scheduler": "trainer.schedule, trainer.warmup_steps and trainer.min_lr_ratio",
    "zero_allow_untested_optimizer": "deepspeed.offload_optimizer",
    "zero_force_ds_cpu_optimizer": "deepspeed.offload_optimizer",
}
DERIVED_ZERO = {
    "stage": "deepspeed.stage",
    "offload_optimizer": "deepspeed.offload_optimizer",
    "offload_param": "deepspeed.offload_param",
    "overlap_comm": "deepspeed.overlap_comm",
    "contiguous_gradients": "deepspeed.contiguous_gradients",
    "reduce_bucket_size": "deepspeed.reduce_bucket_size",
    "stage3_gather_16bit_weights_on_model_save": "deepspeed.stage3_gather_16bit_weights_on_model_save",
}


def _extra(ds) -> dict[str, Any]:
    extra = OmegaConf.to_container(ds.extra, resolve=True) if not isinstance(ds.extra, dict) else ds.extra
    return dict(extra or {})


def build_deepspeed_config(cfg, world_size: int, bf16: bool) -> dict[str, Any]:
    t, ds = cfg.trainer, cfg.deepspeed
    zero: dict[str, Any] = {"stage": ds.stage}
    if ds.stage > 0:
        zero.update(
            overlap_comm=ds.overlap_comm,
            contiguous_gradients=ds.contiguous_gradients,
            reduce_bucket_size=ds.reduce_bucket_size,
        )
    if ds.offload_optimizer:
        if ds.stage == 0:
            raise ConfigError("config key 'deepspeed.offload_optimizer' needs deepspeed.stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_param:
        if ds.stage != 3:
            raise ConfigError("config key 'deepspeed.offload_param' needs deepspeed.stage=3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if ds.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.stage3_gather_16bit_weights_on_model_save
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.offload_optimizer:
        # The trainer passes DeepSpeedCPUAdam itself when offloading.
        config["zero_force_ds_cpu_optimizer"] = True
    else:
        config["zero_allow_untested_optimizer"] = True
    extra = _extra(ds)
    _refuse_derived(extra)
    zero.update(extra.pop("zero_optimization", None) or {})
    config.update(extra)
    return config


def _refuse_derived(extra: dict[str, Any]) -> None:
    zero = extra.get("zero_optimization")
    if zero is not None and not isinstance(zero, dict):
        raise ConfigError(f"config key 'deepspeed.extra.zero_optimization' must be a mapping, got {zero!r}")
    found = [f"'deepspeed.extra.{key}' (set {instead})" for key, instead in DERIVED.items() if key in extra]
    found += [f"'deepspeed.extra.zero_optimization.{key}' (set {instead})"
              for key, instead in DERIVED_ZERO.items() if key in (zero or {})]
    if found:
        raise ConfigError("config keys derived by the trainer cannot be set through deepspeed.extra: "
                          + "; ".join(found))


class _Recorder(dict):
    """A config dict that records every top-level key DeepSpeed's parser looks up."""

    def __init__(self, data: dict[str, Any], seen: set[str]):
        super().__init__(data)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _RecordedKeys(self)

    def __copy__(self):
        return self


class _RecordedKeys:
    def __init__(self, owner: _Recorder):
        self.owner = owner

    def __contains__(self, key):
        self.owner.seen.add(key)
        return dict.__contains__(self.owner, key)

    def __iter__(self):
        return iter(dict.keys(self.owner))

    def __len__(self):
        return dict.__len__(self.owner)


# Read by DeepSpeed outside DeepSpeedConfig's parser (engine/initialize paths).
_READ_ELSEWHERE = {"sequence_parallel_size", "steps_per_print", "wall_clock_breakdown"}


def check_deepspeed_config(cfg) -> None:
    """At start: derived keys in ``deepspeed.extra`` are refused (naming the trainer key) and every
    other key must be one DeepSpeed reads; DeepSpeed's own validation of the values runs too."""
    config = build_deepspeed_config(cfg, world_size=1, bf16=False)
    extra = _extra(cfg.deepspeed)
    if not extra:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as init_distributed does, before DeepSpeed loads
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()
    try:
        DeepSpeedConfig(_Recorder(config, seen))
    except Exception as err:  # noqa: BLE001 (pydantic ValidationError, AssertionError, ValueError ...)
        detail = " ".join(line.strip() for line in str(err).splitlines() if "errors.pydantic.dev" not in line)
        raise ConfigError(f"config key 'deepspeed.extra': DeepSpeed rejects the config: "
                          f"{type(err).__name__}: {detail}") from None
    known = seen | _READ_ELSEWHERE
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            derived = [c for c in close if c in DERIVED]
            if derived:
                hint += f" ({derived[0]} is derived: set {DERIVED[derived[0]]})"
            raise ConfigError(f"config key 'deepspeed.extra.{key}' is not a DeepSpeed config key "
                              f"(DeepSpeed would ignore it){hint}")
