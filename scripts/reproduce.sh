#!/usr/bin/env bash
# bash scripts/reproduce.sh [--real [--chunk-dir DIR [--chunk-steps STEP ...]]] [--only STEP ...] [--dry-run]
# Sets up .venv (as the quick start does), then runs the embedded default's conversions, their CPU
# benchmarks and the summary (docs/results/summary.md) in order (pardec/cli/reproduce.py); re-running
# skips finished steps and resumes an interrupted one. --real: the SmolLM2-135M pipeline instead
# (docs/results/real_cpu.md); --chunk-dir DIR keeps its chunked tables' chunks under DIR, not the committed ones
# (--chunk-steps: only those steps' chunks).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec .venv/bin/python -m pardec.cli.reproduce "$@"
