#!/usr/bin/env bash
# On a GPU machine (no network): install the mtl packages into its python3 without touching
# its torch. Every third-party dependency mtl needs for training is already in that image
# (see ../shared/GPU.md); zarr (only for `mtl ckpt inspect`) is not needed to train. mtl-quant
# (the fp8 backend) is installed too, for tests/gpu, and mtl-serve's engine for bench_serve.py (its HTTP
# server needs fastapi and uvicorn, not in the image); mtl-te needs Transformer Engine (te_stage.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
for p in core parallel models data ckpt train cli quant serve; do
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "packages/$p"
done
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
