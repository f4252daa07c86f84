"""One run per output directory: an exclusive ``flock`` on ``<output_dir>/.lock``.

Rank 0 takes the lock before it writes anything (config.yaml, checkpoints, metrics) and holds it
until the run ends; the kernel releases it when the process dies, so a lock is never stale. The
holder (host, pid, start time, command line) is written into the file, and a second run refusing
names it. Multi-stage runs lock the root ``output_dir``. ``flock`` is honoured by local
filesystems and by Lustre/NFSv4 mounts that support it (Lustre needs the ``flock`` mount option).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Self

from pardec.common.errors import CheckpointError

LOCK_FILE = ".lock"


class RunLock:
    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder unknown (still starting)"
            os.close(fd)
            raise CheckpointError(
                f"output directory {self.path.parent} is in use by another run: {holder} (lock file {self.path}). "
                f"Wait for that run to end, stop it, or choose another output_dir.") from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # before unlocking, so the next holder's line is never clobbered
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
