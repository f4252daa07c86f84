"""pardec.trainers.extension_builds: JIT op builds go to the interpreter's own directory, builds of this
project's processes are serialised, and a lock left by a killed build is cleared, not waited on."""

from __future__ import annotations

import fcntl
import sys
from pathlib import Path

import pytest

from pardec.trainers.extension_builds import GUARD_FILE, guarded_extension_builds


def test_default_directory_is_the_interpreters_own(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    env: dict[str, str] = {}
    with guarded_extension_builds(env) as root:
        assert root == tmp_path / "torch_extensions" and env["TORCH_EXTENSIONS_DIR"] == str(root)


@pytest.mark.parametrize("depth", [("deepspeed_shm_comm",), ("py311_cpu", "deepspeed_shm_comm")])
def test_lock_left_by_a_killed_build_is_removed(tmp_path, depth):
    lock = tmp_path.joinpath(*depth, "lock")
    lock.parent.mkdir(parents=True)
    lock.touch()
    built = lock.parent / "deepspeed_shm_comm.so"
    built.touch()
    with guarded_extension_builds({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) as root:
        assert root == tmp_path and not lock.exists() and built.exists()


def test_guard_is_exclusive_while_held(tmp_path):
    with (guarded_extension_builds({"TORCH_EXTENSIONS_DIR": str(tmp_path)}),
          open(Path(tmp_path) / GUARD_FILE) as other, pytest.raises(BlockingIOError)):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(Path(tmp_path) / GUARD_FILE) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on exit
