"""The FP8 GEMMs of one reference-model layer (issue 7), one way against another.

    python3 benchmarks/gpu/fp8_gemm_bench.py [--tokens 8192] [--out FILE]

For each linear of the reference model (QKV, attention projection, SwiGLU's fc1, fc2) at
``--tokens`` tokens (micro-batch 4 x seq 2048), per call, in ms:
- forward ``y = x Wᵀ``: exact accumulation against Hopper's fast accumulation
  (``train.fp8_fast_accumulation``);
- weight gradient into the fp32 ``main_grad``: ``torch._scaled_mm`` writing bf16 then a
  separate add (the path before ``mtl.quant.cublaslt``) against cuBLASLt adding in its epilogue.
The last two columns scale each saving to a step (24 layers x 8 micro-batches)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import cuda_ms_per_call  # noqa: E402
from mtl.quant.cublaslt import fp8_gemm_accumulate
from mtl.quant.scaled_matmul import scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HIDDEN, FFN = 2048, 5632
LINEARS = {"qkv": (3 * HIDDEN, HIDDEN), "proj": (HIDDEN, HIDDEN), "fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}
CALLS_PER_STEP = 24 * 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out")
    args = parser.parse_args()
    m = args.tokens
    one = torch.tensor(1.0, device="cuda")
    rows = ["| linear [N, K] | forward exact | forward fast | wgrad bf16 + add | wgrad cuBLASLt accumulate | "
            "saved per step: fast forward | saved per step: wgrad |", "|---|---|---|---|---|---|---|"]
    total_fast = total_wgrad = 0.0
    for name, (n, k) in LINEARS.items():
        x = torch.randn(m, k, device="cuda").to(E4M3)
        w = torch.randn(n, k, device="cuda").to(E4M3)
        dyt = torch.randn(n, m, device="cuda").to(E5M2)  # dyᵀ [N, M]
        xt = torch.randn(k, m, device="cuda").to(E4M3)  # xᵀ [K, M]
        main_grad = torch.zeros(n, k, device="cuda")
        exact = cuda_ms_per_call(lambda: scaled_mm(x, one, w, one, torch.bfloat16, False))
        fast = cuda_ms_per_call(lambda: scaled_mm(x, one, w, one, torch.bfloat16, True))
        added = cuda_ms_per_call(lambda: main_grad.add_(scaled_mm(dyt, one, xt, one, torch.bfloat16)))
        fused = cuda_ms_per_call(lambda: fp8_gemm_accumulate(main_grad, dyt, one, xt, one))
        saved_fast, saved_wgrad = (exact - fast) * CALLS_PER_STEP, (added - fused) * CALLS_PER_STEP
        total_fast, total_wgrad = total_fast + saved_fast, total_wgrad + saved_wgrad
        rows.append(f"| {name} [{n}, {k}] | {exact:.3f} | {fast:.3f} | {added:.3f} | {fused:.3f} | "
                    f"{saved_fast:.1f} ms | {saved_wgrad:.1f} ms |")
    rows.append(f"| all four | | | | | **{total_fast:.1f} ms** | **{total_wgrad:.1f} ms** |")
    text = (f"FP8 GEMMs per call (ms), {m} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n"
            + "\n".join(rows) + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
