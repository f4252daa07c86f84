#!/usr/bin/env bash
# bash scripts/quickstart.sh
# Sets everything up, trains the embedded default's small AR base on generated word problems (CPU,
# about 10 minutes on 2 cores), exports it as a Hugging Face checkpoint, validates it on 200
# held-out problems and prints the results table. Re-running resumes / skips finished work.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
.venv/bin/pardec-train experiment=default_base "$@"
.venv/bin/pardec-validate checkpoint=runs/default_base/hf decoder=ar_greedy data=synthetic_gsm
