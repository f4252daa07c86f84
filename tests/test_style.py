"""The repository passes ``ruff check`` with the rules pyproject.toml selects (pycodestyle errors and
warnings with 120-character lines, pyflakes, import order), so the test command is also the lint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO, capture_output=True, text=True)
    missing = "ruff is missing: pip install -e '.[dev]' (bash scripts/setup.sh installs it)"
    assert "No module named ruff" not in result.stderr, missing
    assert result.returncode == 0, result.stdout + result.stderr
