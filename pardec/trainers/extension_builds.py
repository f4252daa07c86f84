"""Where DeepSpeed's just-in-time C++ ops (on CPU: the shared-memory all-reduce, built by
``deepspeed.init_distributed``) are compiled, and no endless wait on a build that died.

torch builds such ops under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
holding a ``lock`` file while it compiles; another process finding that file waits, with no time
limit, until it is gone. Two virtual environments sharing the default directory rebuild the op
each time the other one ran (the build command names the interpreter), and a process killed while
it compiles leaves the file behind: every later run then hangs at start without a word.

So, unless the user chose a directory, builds go to ``<venv>/torch_extensions`` (one per
interpreter prefix), and :func:`guarded_extension_builds` serialises the build section of this
project's processes with an ``flock`` (the kernel releases it when its holder dies): whoever holds
it knows that no other build is running, so any torch ``lock`` file it finds was left by a killed
build and is removed (logged).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
GUARD_FILE = "pardec-build.flock"


@contextmanager
def guarded_extension_builds(environ: MutableMapping[str, str] = os.environ) -> Iterator[Path]:
    """Hold the build guard of ``TORCH_EXTENSIONS_DIR`` (set to the interpreter's own if unset),
    after clearing build locks that no live build holds; yields the directory."""
    root = Path(environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / GUARD_FILE, "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits only while another process of ours is building
        try:
            for stale in sorted(root.glob("*/lock")) + sorted(root.glob("*/*/lock")):
                log.warning("removing %s, left by an interrupted build of the '%s' op", stale, stale.parent.name)
                stale.unlink(missing_ok=True)
            yield root
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
