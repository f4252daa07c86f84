"""The DeepSpeed JSON, derived from the trainer config: batch keys are computed, never typed twice."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


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
            raise ValueError("config key 'deepspeed.offload_optimizer' needs deepspeed.stage >= 1")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_param:
        if ds.stage != 3:
            raise ValueError("config key 'deepspeed.offload_param' needs deepspeed.stage=3")
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
    extra = OmegaConf.to_container(ds.extra, resolve=True) if not isinstance(ds.extra, dict) else ds.extra
    config.update(extra or {})
    return config
