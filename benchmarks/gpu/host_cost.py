"""Host time per call of mtl's own Triton operators, called eagerly and from a compiled function, on
small tensors (so the device never holds the host back).

    python3 benchmarks/gpu/host_cost.py [--calls 2000]

A compiled layer's backward runs ``mtl::swiglu_backward`` and ``mtl::rope_qkv_backward`` once per
layer and micro-batch (384 calls per step of the reference model). As opaque ops, their dispatch and
Triton's JIT launch were the top of the host's profile at tiny shapes (benchmarks/RESULTS.md); as
``triton_op``s, a compiled graph launches their kernels from inductor's own code. The rows compare
the op called eagerly, the kernel's function as the autograd Functions call it when not compiling
(train.compile off: no op dispatch), and the op inside a compiled function, against one ATen kernel.
"""

from __future__ import annotations

import argparse
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    import mtl.models.gpt.rope_qkv as rq
    import mtl.models.swiglu as sw

    dev, bf = "cuda", torch.bfloat16
    x, g = torch.randn(64, 2 * 256, device=dev, dtype=bf), torch.randn(64, 256, device=dev, dtype=bf)
    b, s, heads, groups, d = 1, 16, 4, 2, 32
    dq = torch.randn(b, s, heads, d, device=dev, dtype=bf)
    dk, dv = torch.randn(b, s, groups, d, device=dev, dtype=bf), torch.randn(b, s, groups, d, device=dev, dtype=bf)
    cos, sin = torch.randn(1, s, 1, d, device=dev), torch.randn(1, s, 1, d, device=dev)

    def compiled(op):  # what a compiled layer's backward does: inductor's code launches the kernel
        return torch.compile(op, fullgraph=True)

    add_one = compiled(lambda t: t + 1)
    swiglu_c = compiled(lambda a, b: sw.swiglu_backward(a, b))
    rope_c = compiled(lambda *t: rq.rope_qkv_backward(*t))
    rows = [
        ("torch.empty_like (a floor)", lambda: torch.empty_like(x)),
        ("x + 1 (one ATen kernel)", lambda: x + 1),
        ("mtl::swiglu_backward (the op, eager)", lambda: torch.ops.mtl.swiglu_backward(x, g)),
        ("mtl::rope_qkv_backward (the op, eager)", lambda: torch.ops.mtl.rope_qkv_backward(dq, dk, dv, cos, sin)),
        # what the autograd Functions call when not compiling: the kernel's launch, no op dispatch
        ("swiglu backward as an eager backward calls it (no op)", lambda: sw._swiglu_backward(x, g, traced=False)),
        ("rope backward as an eager backward calls it (no op)",
         lambda: rq._rope_qkv_backward(dq, dk, dv, cos, sin, traced=False)),
        ("compiled x + 1 (a compiled function's own cost + one kernel)", lambda: add_one(x)),
        ("compiled mtl::swiglu_backward", lambda: swiglu_c(x, g)),
        ("compiled mtl::rope_qkv_backward", lambda: rope_c(dq, dk, dv, cos, sin)),
    ]
    print("| call | host µs per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
