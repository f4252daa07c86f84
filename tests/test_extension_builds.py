"""trainers.extension_builds: JIT op builds go to the interpreter's own directory, and a lock left by
an interrupted build is a named error instead of an endless wait."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from trainers.extension_builds import STALE_LOCK_SECONDS, prepare_extension_builds


def test_default_directory_is_the_interpreters_own():
    env: dict[str, str] = {}
    root = prepare_extension_builds(env)
    assert env["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions") == str(root)


def test_user_choice_is_kept_and_fresh_locks_are_waited_for(tmp_path):
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # a build in progress right now
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert prepare_extension_builds(env) == tmp_path and env["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


@pytest.mark.parametrize("depth", [("deepspeed_shm_comm",), ("py311_cpu", "deepspeed_shm_comm")])
def test_stale_lock_is_named(tmp_path, depth):
    lock = tmp_path.joinpath(*depth, "lock")
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = lock.stat().st_mtime - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.raises(ConfigError, match=r"deepspeed_shm_comm.*interrupted.*delete that file"):
        prepare_extension_builds({"TORCH_EXTENSIONS_DIR": str(tmp_path)})
