"""Preemption: SIGTERM / SIGUSR1, or a stop file, make the trainer checkpoint and exit cleanly.

Signals reach the worker processes when they are sent to them directly. Under torchrun + Slurm the
signal may only reach the batch shell, so ``scripts/slurm/train.sbatch`` traps it and creates the
stop file ``<output_dir>/STOP`` on the shared filesystem; every rank polls the flag at each
optimiser step and agrees (all-reduce) before checkpointing together.
"""

from __future__ import annotations

import signal
from pathlib import Path

STOP_FILE = "STOP"
PREEMPTED_MARKER = "PREEMPTED"


class PreemptionWatch:
    def __init__(self, output_dir: Path):
        self.stop_file = output_dir / STOP_FILE
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self) -> bool:
        return self.received is not None or self.stop_file.exists()

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def reason(self) -> str:
        if self.received is not None:
            return signal.Signals(self.received).name
        return f"stop file {self.stop_file}"
