#!/usr/bin/env bash
# Creates .venv (if missing) and installs every mtl package editable, with the test extras.
# torch: the version MTL_TORCH_VERSION names (default 2.13.0), from pip's configured index;
# MTL_TORCH_VERSION=installed keeps the torch the environment already has.
# A second run with nothing changed (same pyproject files, same torch choice) prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${MTL_TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.mtl-setup
WANT=$( (echo "torch=$TORCH"; cat scripts/setup.sh packages/*/pyproject.toml examples/plugins/*/pyproject.toml) \
  | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
if [ "$TORCH" != "installed" ]; then
  "${PIP[@]}" "torch==$TORCH"
fi
"${PIP[@]}" \
  -e packages/core -e "packages/parallel[test]" -e "packages/models[test]" -e "packages/data[test]" \
  -e "packages/ckpt[test]" -e "packages/train[test]" -e "packages/serve[test]" -e "packages/cli[test]" -e "packages/quant[test]" -e "packages/te[test]" \
  -e examples/plugins/mtl-example-plugin -e examples/plugins/mtl-example-family pytest pytest-timeout nox
# Triton for running mtl's Triton kernels in its interpreter on CPU (tests/test_triton_interpreted.py),
# in a folder of its own: the rest of the suite sees the CPU-only torch as users have it. Triton
# ships Linux wheels only; elsewhere that test says it has none.
if [ "$(uname -s)" = Linux ]; then
  "${PIP[@]}" --no-deps --upgrade --target .venv/triton-interpreter "triton==3.5.0"
fi
echo "$WANT" > "$STAMP"
