#!/usr/bin/env bash
# Sets up .venv and runs every test of every package. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
