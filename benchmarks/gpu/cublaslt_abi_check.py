"""Check mtl.quant.cublaslt's enum values and struct size against the installed cublasLt.h.

    python3 benchmarks/gpu/cublaslt_abi_check.py

mtl-quant calls cuBLASLt through ctypes, so it carries the header's numbers itself. This
compiles a few lines of C against the header of the CUDA that torch uses (the
``nvidia-cublas`` wheel's, else ``$CUDA_HOME``), prints each value next to mtl's, and exits 1
on any difference. Needs gcc and the header (the GPU machine has both)."""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
import tempfile

import torch

from mtl.quant import cublaslt

CHECKS = {  # C expression -> mtl's value
    "CUDA_R_32F": cublaslt._CUDA_R_32F,
    "CUDA_R_8F_E4M3": cublaslt._FP8_TYPES[torch.float8_e4m3fn],
    "CUDA_R_8F_E5M2": cublaslt._FP8_TYPES[torch.float8_e5m2],
    "CUBLAS_COMPUTE_32F": cublaslt._COMPUTE_32F,
    "CUBLAS_STATUS_NOT_SUPPORTED": cublaslt._STATUS_NOT_SUPPORTED,
    "CUBLAS_OP_N": cublaslt._OP_N,
    "CUBLAS_OP_T": cublaslt._OP_T,
    "CUBLASLT_MATMUL_DESC_TRANSA": cublaslt._DESC_TRANSA,
    "CUBLASLT_MATMUL_DESC_TRANSB": cublaslt._DESC_TRANSB,
    "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER": cublaslt._DESC_A_SCALE_POINTER,
    "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER": cublaslt._DESC_B_SCALE_POINTER,
    "CUBLASLT_MATMUL_DESC_FAST_ACCUM": cublaslt._DESC_FAST_ACCUM,
    "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES": cublaslt._PREF_MAX_WORKSPACE_BYTES,
    "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES": cublaslt._PREF_MIN_ALIGNMENT_BYTES[0],
    "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES": cublaslt._PREF_MIN_ALIGNMENT_BYTES[1],
    "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES": cublaslt._PREF_MIN_ALIGNMENT_BYTES[2],
    "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES": cublaslt._PREF_MIN_ALIGNMENT_BYTES[3],
    "sizeof(cublasLtMatmulAlgo_t)": ctypes.sizeof(cublaslt._Algo),
    "sizeof(cublasLtMatmulHeuristicResult_t)": ctypes.sizeof(cublaslt._HeuristicResult),
    "offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize)": cublaslt._HeuristicResult.workspace_size.offset,
}


def include_dirs() -> list[str]:
    dirs = []
    for pattern in ("nvidia/cublas/include", "nvidia/cu*/include", "nvidia/cuda_runtime/include"):
        for base in sys.path:
            dirs += glob.glob(os.path.join(base, pattern))
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    dirs.append(os.path.join(cuda_home, "include"))
    return [d for d in dirs if os.path.isdir(d)]


def main() -> int:
    dirs = include_dirs()
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include <cublasLt.h>', 'int main(void) {']
    lines += [f'  printf("%ld\\n", (long)({expr}));' for expr in CHECKS]
    lines += ['  return 0;', '}']
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = os.path.join(tmp, "abi.c"), os.path.join(tmp, "abi")
        with open(source, "w") as f:
            f.write("\n".join(lines) + "\n")
        subprocess.run(["gcc", source, "-o", binary, *[f"-I{d}" for d in dirs]], check=True)
        values = [int(v) for v in subprocess.run([binary], check=True, capture_output=True, text=True).stdout.split()]
    bad = 0
    for (expr, ours), theirs in zip(CHECKS.items(), values):
        mark = "ok" if ours == theirs else "MISMATCH"
        bad += ours != theirs
        print(f"{mark:8} {expr} = {theirs} (mtl: {ours})")
    print(f"headers from: {dirs}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
