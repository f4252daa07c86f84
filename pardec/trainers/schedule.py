"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``min_lr_ratio`` or constant."""

from __future__ import annotations

import math

import torch


def warmup_steps(trainer_cfg) -> int:
    return max(trainer_cfg.warmup_steps, int(trainer_cfg.warmup_ratio * trainer_cfg.max_steps))


def lr_multiplier(step: int, trainer_cfg) -> float:
    warm = warmup_steps(trainer_cfg)
    total = trainer_cfg.max_steps
    if step < warm:
        return (step + 1) / warm
    if trainer_cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total - warm))
    floor = trainer_cfg.min_lr_ratio
    if trainer_cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, trainer_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, trainer_cfg))
