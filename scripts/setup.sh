#!/usr/bin/env bash
# Creates .venv (if missing) and installs every mtl package editable, with test extras.
# torch is pinned to the CPU build that lies on this machine's disk; on a GPU machine, the
# installed torch is kept (pip sees it satisfies the range).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${MTL_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q \
  -e packages/core -e "packages/parallel[test]" -e "packages/models[test]" -e "packages/data[test]" \
  -e "packages/ckpt[test]" -e "packages/train[test]" -e "packages/cli[test]" \
  -e examples/plugins/mtl-example-plugin pytest pytest-timeout nox
