"""Data-parallel validation under torchrun: sharding and gathering.

The process group comes from :func:`pardec.common.distributed.init_distributed` (started only when
``WORLD_SIZE`` > 1, or reused inside training). Rank r decodes samples ``r, r + world,
r + 2·world, ...`` of the eval set; per-sample records are gathered to rank 0 with
``all_gather_object`` and sorted by index, so rank 0 sees the same records (timing aside) as a
single process would.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from pardec.common.distributed import DistInfo


def shard_indices(num_samples: int, info: DistInfo) -> list[int]:
    """Indices of the eval samples this rank decodes (strided: i ≡ rank mod world)."""
    return list(range(info.rank, num_samples, info.world_size))


def gather_records(records: list[dict[str, Any]], info: DistInfo) -> list[dict[str, Any]]:
    """All ranks' records on rank 0, sorted by ``index``; other ranks get an empty list."""
    if info.world_size == 1:
        return sorted(records, key=lambda r: r["index"])
    gathered: list[list[dict[str, Any]] | None] = [None] * info.world_size
    dist.all_gather_object(gathered, records)
    if not info.is_main:
        return []
    return sorted((r for part in gathered for r in part), key=lambda r: r["index"])


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank of ``info``'s world."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
