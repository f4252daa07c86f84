"""The wheel a user installs: only the ``pardec`` package at the top level of site-packages (no
``common``/``models``/... colliding with other projects), the recipes shipped as package data, and the
console commands working from a plain (not editable) install in a fresh virtual environment.

Offline: the wheel is built with this environment's setuptools (no build isolation) and installed
without its dependencies; the installed command then finds them through ``PYTHONPATH`` pointing at
this environment's site-packages, after the fresh install's own."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(REPO)], check=True, capture_output=True, text=True)
    (found,) = out.glob("pardec-*.whl")
    return found


def test_the_wheel_holds_only_the_pardec_package_and_its_recipes(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"pardec"}
    assert "pardec/recipes/train.yaml" in names and "pardec/recipes/experiment/default_base.yaml" in names
    assert not [n for n in names if n.startswith("pardec/benchmarks/results")]


def test_a_fresh_install_has_only_pardec_and_its_commands_start(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    before = {p.name for p in site.iterdir()}
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True)
    added = {p.name for p in site.iterdir()} - before
    assert {name for name in added if not name.endswith(".dist-info")} == {"pardec"}, added

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{sysconfig.get_paths()['purelib']}", "OMP_NUM_THREADS": "1"}
    for command in ("pardec-train", "pardec-validate"):
        assert command in scripts
        proc = subprocess.run([str(env_dir / "bin" / command), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "experiment" in proc.stdout or "checkpoint" in proc.stdout  # Hydra composed the packaged recipes
    proc = subprocess.run([str(python), "-c", "import pardec.cli.train as m; print(m.__file__)"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.startswith(str(site))  # the installed copy, not the checkout
