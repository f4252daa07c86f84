#!/usr/bin/env bash
# bash scripts/setup.sh
# Creates .venv, installs torch (a CPU build when the machine has no NVIDIA GPU, so no CUDA wheels
# are pulled) and then pardec with its test tools from pyproject.toml. Idempotent.
#   PARDEC_VENV        virtual environment directory (default .venv)
#   PARDEC_TORCH       torch requirement (default torch==2.13.*, the tested version)
#   PARDEC_TORCH_CPU_INDEX  index of CPU wheels (default the PyTorch CPU index)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${PARDEC_VENV:-.venv}"
torch_req="${PARDEC_TORCH:-torch==2.13.*}"
cpu_index="${PARDEC_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip)

if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found: installing $torch_req with CUDA from PyPI"
  "${pip[@]}" install "$torch_req"
else
  echo "setup: no GPU: installing the CPU build of $torch_req"
  # The CPU index is first choice; a CPU wheel found elsewhere (+cpu local version) sorts above
  # the CUDA build of the same version, so CUDA wheels are never pulled here.
  "${pip[@]}" install --retries 1 --timeout 30 --index-url "$cpu_index" \
    --extra-index-url https://pypi.org/simple "$torch_req"
  "$venv/bin/python" -c "import torch, sys; sys.exit(0 if not torch.version.cuda else 'setup: got a CUDA torch on a CPU machine')"
fi

"${pip[@]}" install -e ".[dev]"
echo "setup: done. Optional on GPU nodes: $venv/bin/pip install -e '.[gpu]' (flash-attn)"
