"""Data-parallel validation under torchrun: process group, sharding, gathering.

With ``WORLD_SIZE`` > 1 (set by torchrun) :func:`init_distributed` starts a process group (NCCL on
GPU, gloo on CPU) unless one is already running (e.g. inside training). Rank r decodes samples
``r, r + world, r + 2·world, ...`` of the eval set; per-sample records are gathered to rank 0 with
``all_gather_object`` and sorted by index, so rank 0 sees the same records (timing aside) as a
single process would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # True when this module created the process group (and must destroy it).
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_context() -> DistContext:
    """The running process group's rank/world, or a single-process context."""
    if dist.is_available() and dist.is_initialized():
        return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return DistContext()


def init_distributed() -> DistContext:
    """Start a process group when launched with WORLD_SIZE > 1 and none exists yet."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 or dist.is_initialized():
        return current_context()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    ctx = current_context()
    ctx.owns_group = True
    return ctx


def shutdown(ctx: DistContext) -> None:
    """Destroy the group this module created, once every rank got here: tearing gloo down while a
    peer is still inside its last collective aborts that peer ("terminate called without an
    active exception")."""
    if ctx.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_indices(num_samples: int, ctx: DistContext) -> list[int]:
    """Indices of the eval samples this rank decodes (strided: i ≡ rank mod world)."""
    return list(range(ctx.rank, num_samples, ctx.world_size))


def gather_records(records: list[dict[str, Any]], ctx: DistContext) -> list[dict[str, Any]]:
    """All ranks' records on rank 0, sorted by ``index``; other ranks get an empty list."""
    if ctx.world_size == 1:
        return sorted(records, key=lambda r: r["index"])
    gathered: list[list[dict[str, Any]] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, records)
    if not ctx.is_main:
        return []
    return sorted((r for part in gathered for r in part), key=lambda r: r["index"])


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
