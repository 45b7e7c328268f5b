#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute, CuTe DSL) on a GPU machine without network, from wheels that
# travel in the ignored folder .whl/fa4 (carry ".whl"): attention_bench.py and bench.sdpa=fa4.
#
# Staging, on a machine with pip (here): the CUDA 13 library wheel of the CuTe DSL is 92 MB, more
# than a device call carries, so it travels as its contents re-compressed with xz (53 MB):
#   d=.whl/fa4; mkdir -p $d /tmp/fa4 && cd /tmp/fa4
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
#     flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
#     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
#     quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5
#   mkdir x && (cd x && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl && tar cf - . |
#     xz -T1 --lzma2=preset=9e,dict=512MiB,nice=273 > ../libs_cu13.tar.xz)
#   cp libs_cu13.tar.xz $(ls *.whl | grep -v libs_cu13) <repo>/$d
# (cuda-bindings, cuda-pathfinder, einops, protobuf and typing_extensions are in the GPU image.)
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --no-compile .whl/fa4/*.whl
# the cu13 library wheel's contents (dist-info included), unpacked where pip would put them
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .whl/fa4/libs_cu13.tar.xz "$site"
python3 -c "import flash_attn.cute.interface, cutlass; print('flash_attn.cute imported; cutlass dsl', cutlass.__version__ if hasattr(cutlass, '__version__') else '')"
