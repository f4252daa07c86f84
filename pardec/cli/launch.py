# python -m pardec.cli.launch --nproc_per_node 8 -m pardec.cli.train experiment=<x> ...   (torchrun's arguments)
"""torchrun that exits with its workers' exit code.

torchrun itself exits 1 (with a ChildFailedError traceback) whenever a worker exits non-zero, so a
preempted run (``PREEMPTED_EXIT_CODE`` in ``pardec/trainers/preemption.py``) could not be told apart from a
crash. This runs the same launcher and exits with the exit code of the first worker that failed
(128 + N for a worker killed by signal N). The Slurm templates (``scripts/slurm/preamble.sh``) use it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"launch: rank {rank} exited with {failure.exitcode} first; exiting with {code}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
