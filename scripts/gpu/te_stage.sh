#!/usr/bin/env bash
# Stage Transformer Engine (PyTorch) on an offline GPU machine, the recipe of shared/GPU.md.
#
#   scripts/gpu/te_stage.sh download          # here, with network: wheels into .whl/ (ignored)
#   scripts/gpu/te_stage.sh stage PIECE       # GPU machine, one call per piece of the cu13 wheel
#   scripts/gpu/te_stage.sh install [DIR]     # GPU machine, last call: join, verify, install, build
#
# TE is three pieces: transformer_engine (pure Python), transformer_engine_cu13 (a 276 MB wheel
# whose library does not compress: too large for one transfer of at most 64 MiB, so it travels
# in pieces of PIECE_MB, each copied to $STAGE outside the repository, on calls back to back
# so that the machine stays the same) and transformer_engine_torch (an sdist: a C++ torch
# extension built there against the installed torch, Hopper only, ~2 minutes on 16 cores).
# Its Python side also imports pydantic and nvdlfw-inspect, and the build needs the
# cudnn-frontend headers; none of them is in the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
TE_VERSION=${TE_VERSION:-2.20.2}
PIECE_MB=${PIECE_MB:-56}
STAGE=${STAGE:-/tmp/te}
WHEELS=.whl/te      # the cu13 wheel and its pieces
EXTRAS=.whl/te2     # everything else (about 16 MB): carried with the last piece
CU13=transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl
PY=${PYTHON:-python3}

download() {
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '.whl/' .gitignore || echo /.whl/ >> .git/info/exclude
  mkdir -p "$WHEELS" "$EXTRAS"
  local get=("$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
             --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64)
  "${get[@]}" -d "$WHEELS" "transformer_engine_cu13==$TE_VERSION"
  "${get[@]}" --platform any -d "$EXTRAS" "transformer_engine==$TE_VERSION" pydantic pydantic-core \
    annotated-types typing-inspection nvdlfw-inspect nvidia-cudnn-frontend
  # the extension is source only; pip download would try to build its metadata, so fetch the
  # sdist the index lists
  local url
  url=$(curl -fsSL "https://pypi.org/simple/transformer-engine-torch/" \
        | grep -o "https://[^\"#]*transformer_engine_torch-$TE_VERSION.tar.gz" | head -1)
  curl -fsSL -o "$EXTRAS/transformer_engine_torch-$TE_VERSION.tar.gz" "$url"
  (cd "$WHEELS" && rm -f cu13.part.* && split -b "${PIECE_MB}M" "$CU13" cu13.part. && sha256sum "$CU13" > "$CU13.sha256")
  cp "$WHEELS/$CU13.sha256" "$EXTRAS/"
  ls -l "$WHEELS" "$EXTRAS"
  echo "carry one $WHEELS/cu13.part.* per call (stage), then $EXTRAS with the last one (install)"
}

stage() {
  mkdir -p "$STAGE"
  cp "$1" "$STAGE/"
  ls -l "$STAGE"
}

install() {
  local extras=${1:-$EXTRAS}
  [ -n "${2:-}" ] && stage "$2"
  (cd "$STAGE" && cat cu13.part.* > "$CU13")
  (cd "$STAGE" && sha256sum -c "$OLDPWD/$extras/$CU13.sha256")
  "$PY" -m pip install -q --no-index --no-deps "$STAGE/$CU13" "$extras"/*.whl
  rm -rf "$STAGE/te_torch" && mkdir -p "$STAGE/te_torch"
  tar -xzf "$extras/transformer_engine_torch-$TE_VERSION.tar.gz" -C "$STAGE/te_torch" --strip-components=1
  (cd "$STAGE/te_torch" && NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} \
     "$PY" -m pip install -q --no-index --no-deps --no-build-isolation .)
  # TE loads the system cuDNN (/lib/x86_64-linux-gnu) unless told otherwise; once torch has
  # loaded its own (pip nvidia-cudnn), that mix fails ("libcudnn_cnn.so.9: undefined symbol").
  # Seen on the H100 image (2026-11-23); source this file before running mtl with TE.
  local cudnn
  cudnn=$("$PY" -c "import nvidia.cudnn as c; print(list(c.__path__)[0])")
  printf 'export CUDNN_PATH=%s\nexport LD_LIBRARY_PATH=%s/lib:${LD_LIBRARY_PATH:-}\n' "$cudnn" "$cudnn" > "$STAGE/env.sh"
  . "$STAGE/env.sh"
  "$PY" -c "import torch; torch.backends.cudnn.version(); import transformer_engine.pytorch; from importlib.metadata import version; print('transformer_engine', version('transformer_engine'), 'torch', torch.__version__)"
  echo "before using TE: . $STAGE/env.sh"
}

case "${1:-}" in
  download) download ;;
  stage) stage "$2" ;;
  install) shift; install "$@" ;;
  *) sed -n 2,6p "$0"; exit 2 ;;
esac
