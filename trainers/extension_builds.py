"""Where DeepSpeed's just-in-time C++ ops (on CPU: the shared-memory all-reduce, built by
``deepspeed.init_distributed``) are compiled, and a refusal to wait forever on a dead build.

torch builds such ops under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
holding a ``lock`` file while it compiles; another process finding the file waits until it is
gone, with no time limit. Two virtual environments sharing the default directory rebuild the op
each time the other one ran (the build command names the interpreter) and so take that lock
often; a process killed while it compiles leaves the file behind, and every later run then hangs
at start without a word. So, unless the user chose a directory: builds go to ``<venv>/torch_extensions``
(one per interpreter prefix), and a lock file older than ``STALE_LOCK_SECONDS`` (a build takes
well under a minute) is a named error instead of a silent wait.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from common.errors import ConfigError

STALE_LOCK_SECONDS = 600.0


def prepare_extension_builds(environ: dict[str, str] = os.environ, now: float | None = None) -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` to the interpreter's own directory unless set; refuse stale locks."""
    root = Path(environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
    now = time.time() if now is None else now
    for lock in sorted(root.glob("*/lock")) + sorted(root.glob("*/*/lock")):
        age = now - lock.stat().st_mtime
        if age > STALE_LOCK_SECONDS:
            raise ConfigError(
                f"{lock} is {age / 60:.0f} minutes old: a build of the '{lock.parent.name}' op was interrupted and "
                "left its lock behind (a live build takes under a minute); delete that file and start again"
            )
    return root
