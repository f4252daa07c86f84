"""Process groups for torchrun (or a single plain process), shared by training and validation.

:func:`init_distributed` reads torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``)
and starts a group with NCCL on GPU or gloo on CPU. Training needs a group even as a lone process
(DeepSpeed does), so it passes ``single_process_group=True`` and a plain ``python`` run becomes a
world of one; validation starts a group only when launched with more than one rank. A group that
already exists (validation inside training) is reused and never destroyed by :func:`shutdown`.
A CLI entry point holds its group with :func:`process_group`, which destroys it before the process exits;
an owner with no scope to hold it in (lm-eval's model) hands it to :func:`shutdown_at_exit`. Neither
waits for the peers after an error: a rank that fails alone exits, and torchrun stops the others,
instead of the failing rank waiting in a barrier that its peers never reach (until gloo's 30-minute
timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    # True when init_distributed created the process group (and shutdown must destroy it).
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def current() -> DistInfo:
    """The running group's rank and world, or a single process when there is none."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), _local_device(local_rank))
    return DistInfo(device=_local_device(0) if torch.cuda.is_available() else torch.device("cpu"))


def init_distributed(single_process_group: bool = False) -> DistInfo:
    """Start (or join) the process group; see the module docstring.

    On CPU, DeepSpeed's CPU accelerator is selected (``DS_ACCELERATOR=cpu``) before anything
    imports DeepSpeed's accelerator, and gloo is the backend.
    """
    if dist.is_initialized():
        return current()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 and not single_process_group:
        return current()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        dist.init_process_group("gloo")
    info = current()
    return DistInfo(info.rank, info.local_rank, info.world_size, info.device, owns_group=True)


def shutdown(info: DistInfo) -> None:
    """Destroy the group ``init_distributed`` created, once every rank got here: tearing gloo down
    while a peer is still inside its last collective aborts that peer ("terminate called without
    an active exception")."""
    if info.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(single_process_group: bool = False) -> Iterator[DistInfo]:
    """The group of a launcher's whole process (a CLI entry point): :func:`init_distributed` before the
    body, :func:`shutdown` once it returns. Leaving a gloo group to interpreter exit aborts a rank that
    exits while a peer still runs (SIGABRT, "terminate called without an active exception"; under
    torchrun rank 1 leaves the last barrier while rank 0 still releases the run lock and reports), so
    every rank destroys it first. A body that raises skips the shutdown: its barrier would wait for
    peers that are not coming."""
    info = init_distributed(single_process_group)
    yield info
    shutdown(info)


def shutdown_at_exit(info: DistInfo) -> None:
    """:func:`shutdown` at interpreter exit, for a group its owner has no scope to close: skipped when
    the interpreter exits on an uncaught exception (Python has set ``sys.last_value`` by then), for the
    reason :func:`process_group` skips it after an error."""
    if info.owns_group:
        atexit.register(_shutdown_unless_failed, info)


def _shutdown_unless_failed(info: DistInfo) -> None:
    if getattr(sys, "last_value", None) is None:
        shutdown(info)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_rank_first(is_main: bool) -> Iterator[None]:
    """Run the body on the main rank first, then on the others (they wait for it): what the main rank
    writes there, e.g. the datasets cache of a tokenization, the others read instead of writing it too."""
    if not is_main:
        barrier()
    yield
    if is_main:
        barrier()


def _on_backend_device(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if dist.get_backend() == "nccl" else t


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = _on_backend_device(torch.tensor([1.0 if flag else 0.0]))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Mean of each logged float over ranks (one collective for the whole dict)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return values
    keys = sorted(values)
    t = _on_backend_device(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))
