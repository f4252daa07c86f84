"""Preemption: SIGTERM / SIGUSR1, or a stop file, make the trainer checkpoint and exit cleanly.

Signals reach the worker processes when they are sent to them directly. Under torchrun + Slurm the
signal may only reach the batch shell, so ``scripts/slurm/train.sbatch`` traps it and creates the
stop file ``<output_dir>/STOP`` on the shared filesystem; every rank polls the flag at each
optimiser step and agrees (all-reduce) before checkpointing together. A stage of a multi-stage
recipe watches both its own directory's stop file and the run's (``<output_dir>/STOP``). An
honoured stop file is consumed (deleted), so it never stops a later run. A preempted
``pardec/cli/train.py`` exits with ``PREEMPTED_EXIT_CODE``, which ``train.sbatch`` tells apart from
success (0) and from failures, and answers by requeueing the job.
"""

from __future__ import annotations

import signal
from pathlib import Path

STOP_FILE = "STOP"
PREEMPTED_MARKER = "PREEMPTED"
# Exit status of a run that checkpointed and stopped on request (EX_TEMPFAIL in sysexits.h: "try
# again later"). scripts/slurm/train.sbatch requeues the job on it; resuming continues the run.
PREEMPTED_EXIT_CODE = 75


class PreemptionWatch:
    def __init__(self, *directories: Path):
        """Watch ``<directory>/STOP`` for each directory (duplicates ignored) and SIGTERM/SIGUSR1."""
        self.stop_files = list(dict.fromkeys(Path(d) / STOP_FILE for d in directories))
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    @property
    def stop_file(self) -> Path:
        return self.stop_files[0]

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def _present(self) -> list[Path]:
        return [f for f in self.stop_files if f.exists()]

    def requested(self) -> bool:
        return self.received is not None or bool(self._present())

    def consume(self) -> None:
        """Delete the stop files (after the checkpoint), so a left-over file stops no later run."""
        for f in self.stop_files:
            f.unlink(missing_ok=True)

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def reason(self) -> str:
        if self.received is not None:
            return signal.Signals(self.received).name
        present = self._present()
        return f"stop file {present[0] if present else self.stop_file}"
