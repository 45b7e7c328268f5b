#!/usr/bin/env bash
# Sets up .venv and runs the demo: corpus -> preprocess -> train (CPU) -> checkpoint -> sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mtl demo "$@"
