"""On a GPU: the fused weight-gradient accumulation (mtl.parallel.tensor_parallel.wgrad_fusion)
against the unfused pair (bf16 GEMM, then main_grad += grad) for the reference model's
largest weight, numbers and time.

    python3 benchmarks/gpu/wgrad_fusion_check.py [--tokens 8192 --out 5632 --in 2048]

Prints the relative error of each against an fp64 reference (the fused one never rounds the
micro-batch gradient to bf16, so it should be the closer) and the median time of each.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mtl.parallel.tensor_parallel.wgrad_fusion import accumulate_weight_grad


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", type=int, default=5632)
    parser.add_argument("--in", dest="inp", type=int, default=2048)
    a = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(a.tokens, a.out, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(a.tokens, a.inp, device="cuda", generator=g).to(torch.bfloat16)
    start = torch.randn(a.out, a.inp, device="cuda", generator=g)
    reference = start.double() + dy.double().t() @ x.double()

    fused = start.clone()
    accumulate_weight_grad(fused, dy, x)
    unfused = start.clone()
    unfused.add_(dy.t() @ x)

    def rel(t):
        return ((t.double() - reference).norm() / reference.norm()).item()

    print(f"weight [{a.out}, {a.inp}], {a.tokens} tokens, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"relative error vs fp64: fused {rel(fused):.3e}, unfused (bf16 grad, then add) {rel(unfused):.3e}")
    buf = start.clone()
    t_fused = timed(lambda: accumulate_weight_grad(buf, dy, x))
    t_unfused = timed(lambda: buf.add_(dy.t() @ x))
    print(f"median ms: fused {t_fused:.3f}, unfused {t_unfused:.3f} ({t_unfused / t_fused:.2f}x)")


if __name__ == "__main__":
    main()
