#!/usr/bin/env bash
# bash scripts/quickstart.sh
# Sets everything up, trains the embedded default's small AR base on generated word problems (CPU,
# about 10 minutes on 2 cores), exports it as a Hugging Face checkpoint, validates it on 200
# held-out problems and prints the results table. Re-running resumes / skips finished work.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
py=.venv/bin/python
$py -m pardec.cli.train experiment=default_base "$@"
$py -m pardec.cli.validate checkpoint=runs/default_base/hf decoder=ar_greedy data=synthetic_gsm
