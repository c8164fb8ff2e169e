#!/bin/bash
# Installs the tools that check charts/kvgate into a Python venv: `install.sh VENV`
# (`cargo xtask test` and `cargo xtask install` pass target/helm-venv).
#
# - helm-python-sdk 0.2.2: Helm v4 (its Go SDK, built as a shared library) for Python; lint,
#   values-schema validation and rendering with Helm's own engine, without a helm binary or a
#   cluster. tools/helm/render.py drives it.
# - kubernetes-validate 1.37.0: Kubernetes' OpenAPI schemas, offline, up to Kubernetes 1.37.
#
# Both pinned, with their dependencies, in requirements.txt beside this script (installed with
# --no-deps: nothing else comes in). The venv is marked installed (.kvgate-installed, a copy of
# requirements.txt) only when everything succeeded; a half-made venv is made again next time.
set -euo pipefail
V=${1:?usage: install.sh VENV}
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$V"
"${PYTHON:-python3}" -m venv "$V"
"$V/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$HERE/requirements.txt"
"$V/bin/python" - <<'PY'
import helm_python as helm
import kubernetes_validate

print(
    f"Helm {helm.helm_sdk_version()} (helm-python-sdk {helm.__version__}),",
    f"kubernetes-validate {kubernetes_validate.__version__}",
    f"(schemas up to Kubernetes {kubernetes_validate.latest_version()})",
)
PY
cp "$HERE/requirements.txt" "$V/.kvgate-installed"
