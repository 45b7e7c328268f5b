"""mtl.quant.cublaslt's enum values and struct sizes against the installed cublasLt.h.

mtl-quant calls cuBLASLt through ctypes, so it carries the header's numbers itself. This
compiles a few lines of C against the header of the CUDA that torch uses (the ``nvidia-cublas``
wheel's, else ``$CUDA_HOME``) and compares each value with mtl's. Needs gcc and the header
(the GPU machine has both): ``python -m pytest -m gpu tests/gpu/test_cublaslt_abi.py``."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def expected_values() -> dict[str, int]:
    """C expression -> mtl's value."""
    from mtl.quant import cublaslt

    return {
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
    dirs.append(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"))
    return [d for d in dirs if os.path.isdir(d)]


def header_values(expressions: list[str], tmp_path) -> list[int]:
    """Each C expression's value, printed by a program compiled against cublasLt.h."""
    dirs = include_dirs()
    if shutil.which("gcc") is None or not any(os.path.exists(os.path.join(d, "cublasLt.h")) for d in dirs):
        pytest.skip(f"needs gcc and cublasLt.h (looked in {dirs})")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <cublasLt.h>", "int main(void) {"]
    lines += [f'  printf("%ld\\n", (long)({expr}));' for expr in expressions]
    lines += ["  return 0;", "}"]
    source, binary = tmp_path / "abi.c", tmp_path / "abi"
    source.write_text("\n".join(lines) + "\n")
    subprocess.run(["gcc", str(source), "-o", str(binary), *[f"-I{d}" for d in dirs]], check=True)
    return [int(v) for v in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]


def test_cublaslt_constants_match_the_header(tmp_path):
    ours = expected_values()
    theirs = dict(zip(ours, header_values(list(ours), tmp_path)))
    mismatched = {expr: (value, theirs[expr]) for expr, value in ours.items() if theirs[expr] != value}
    assert not mismatched, f"(mtl's value, the header's) differ: {mismatched}"
