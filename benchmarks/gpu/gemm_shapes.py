"""The reference layer's GEMMs alone, each as mtl issues it, under cuBLAS and cuBLASLt.

    cd benchmarks/gpu && python3 gemm_shapes.py [--tokens 8192 --iters 100]

For each projection (qkv, attention output, fc1, fc2) it times the forward (``x @ Wᵀ``), the
input gradient (``dy @ W``) and the weight gradient accumulated into an fp32 ``main_grad``
(``addmm(main_grad, dyᵀ, x, out_dtype=fp32)``, mtl's fusion), and prints µs per call and
TFLOP/s. A GEMM far below the others' rate is one a different kernel or layout could speed up.
``--memsets`` instead lists, per GEMM and library, the kernels one call launches (cuBLAS's own
memsets included: the step's profile shows about one ``Memset (Device)`` per GEMM), so that a
cuBLAS setting (``CUBLAS_WORKSPACE_CONFIG``, ...) can be tried in a process of its own.
Shapes are the reference model's (``llama_reference.toml`` as mtl resolves it: hidden 2048,
SwiGLU width 5440); tokens default to one micro-batch (4 x 2048).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from profile_step import cuda_ms_per_call, kernels_per_call

REFERENCE = Path(__file__).resolve().parent / "llama_reference.toml"


def cases() -> list[tuple[str, int, int]]:
    """(name, out features, in features) of the reference layer's weights (one rank, no tp)."""
    from mtl.core.config_io import load_config

    m = load_config(str(REFERENCE), []).resolve(1, 257).model
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    return [("qkv", qkv, m.hidden_size), ("proj", m.hidden_size, m.num_attention_heads * m.head_dim),
            ("fc1", 2 * m.ffn_hidden_size, m.hidden_size), ("fc2", m.hidden_size, m.ffn_hidden_size)]


def rows_for(tokens: int, name: str, n_out: int, n_in: int) -> list[tuple[str, float, object]]:
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(tokens, n_in, device=dev, dtype=bf)
    w = torch.randn(n_out, n_in, device=dev, dtype=bf) * 0.02
    dy = torch.randn(tokens, n_out, device=dev, dtype=bf)
    main_grad = torch.zeros(n_out, n_in, device=dev, dtype=torch.float32)
    flops = 2.0 * tokens * n_in * n_out
    return [
        (f"{name} forward x@Wt", flops, lambda: torch.nn.functional.linear(x, w)),
        (f"{name} input grad dy@W", flops, lambda: dy @ w),
        (f"{name} weight grad into fp32", flops,
         lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--memsets", action="store_true", help="the kernels of one call, memsets included")
    a = parser.parse_args()
    libraries = ["cublas", "cublaslt"]
    if a.memsets:
        for name, n_out, n_in in cases():
            for label, _, fn in rows_for(a.tokens, name, n_out, n_in):
                for lib in libraries:
                    torch.backends.cuda.preferred_blas_library(lib)
                    try:
                        kernels = kernels_per_call(fn, calls=10)
                    except RuntimeError as err:
                        print(f"{label} [{lib}]: error {str(err).splitlines()[0][:60]}")
                        continue
                    shown = "; ".join(f"{k[:48]} x{n} {ms * 1e3:.1f} µs" for k, ms, n in kernels)
                    print(f"{label} [{lib}]: {shown}", flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        return
    print("| GEMM | " + " | ".join(f"{lib} µs | {lib} TFLOP/s" for lib in libraries) + " |")
    print("|---|" + "---|---|" * len(libraries))
    for name, n_out, n_in in cases():
        for label, flops, fn in rows_for(a.tokens, name, n_out, n_in):
            cells = []
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                try:
                    ms = cuda_ms_per_call(fn, iters=a.iters)
                except RuntimeError as err:  # a library without this GEMM (out_dtype)
                    cells += [f"error: {str(err).splitlines()[0][:40]}", ""]
                    continue
                cells += [f"{ms * 1e3:.1f}", f"{flops / ms / 1e9:.0f}"]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
