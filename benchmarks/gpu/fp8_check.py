"""On a GPU: mtl-quant's FP8 linear at the reference model's shapes against bf16, and a short
training run of a 2-layer slice of the reference model with each backend, compile on and off.

    python3 benchmarks/gpu/fp8_check.py [--iters 8]

Part 1 prints the relative error (Frobenius) of y, dx and dW of one FP8 linear (current
scaling, hybrid format) against the same GEMMs in fp32 from the same bf16 inputs, and then the
same layer compiled (its GEMMs the ``mtl::fp8_gemm`` op, kept whole) against it eager.
Part 2 prints each run's losses; FP8 should follow bf16 closely over a few steps, compiled or
not (when inductor lowered ``torch._scaled_mm`` itself, compiled FP8 stopped learning).
"""

from __future__ import annotations

import argparse
import time

import torch

from mtl.core.registrations import Fp8Settings
from mtl.quant.factories import column_linear
from mtl.quant.weight_cache import invalidate_weight_caches
from mtl.train.testing import run_tiny


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gemm_errors(tokens: int, inp: int, out: int, recipe: str) -> str:
    torch.manual_seed(0)
    layer = column_linear(inp, out, bias=False, init_std=0.02, topology=None,
                          fp8=Fp8Settings(recipe)).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, 1, inp, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, 1, out, device="cuda", dtype=torch.bfloat16) * 1e-4  # loss gradients are small
    y = layer(x)
    y.backward(dy)
    w = layer.weight.detach().float()
    x32 = x.detach().float()
    y_ref = x32 @ w.t()
    dx_ref = dy.float() @ w
    dw_ref = dy.float().reshape(-1, out).t() @ x32.reshape(-1, inp)
    grad_w = layer.weight.grad
    return (f"{recipe:8s} [{tokens}, {inp}] x [{out}, {inp}]: y {rel(y, y_ref):.3e}, dx {rel(x.grad, dx_ref):.3e}, "
            f"dW {rel(grad_w, dw_ref) if grad_w is not None else 'missing'}")


def compiled_vs_eager(tokens: int, inp: int, out: int, recipe: str) -> str:
    """One FP8 layer compiled (fullgraph) against the same layer eager: y, dx, dW."""
    torch.manual_seed(0)
    layer = column_linear(inp, out, bias=False, init_std=0.02, topology=None,
                          fp8=Fp8Settings(recipe)).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, 1, inp, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 1, out, device="cuda", dtype=torch.bfloat16) * 1e-4
    results = []
    torch._dynamo.reset()
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        invalidate_weight_caches()  # each run quantizes W itself (compiled: inside the graph)
        layer.weight.grad = None
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad, layer.weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    return (f"compiled vs eager {recipe:8s} [{tokens}, {inp}] x [{out}, {inp}]: y {rel(y1, y0):.3e}, "
            f"dx {rel(dx1, dx0):.3e}, dW {rel(dw1, dw0) if dw1 is not None else 'missing'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    for recipe in ("current", "rowwise"):
        for inp, out in ((2048, 6144), (2048, 11264), (5632, 2048)):
            print(gemm_errors(8192, inp, out, recipe))
    for recipe in ("current", "rowwise"):
        try:
            print(compiled_vs_eager(8192, 2048, 11264, recipe))
        except Exception as exc:  # report, and go on to the training runs
            print(f"compiled vs eager {recipe}: failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    common = [f"train.iters={args.iters}", "train.device='cuda'", "train.precision='bf16'", "model.num_layers=2",
              "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
              "model.normalization='rmsnorm'", "model.activation='swiglu'", "model.position_embedding='rope'",
              "model.tie_embeddings=false", "train.micro_batch_size=4", "train.global_batch_size=8", "train.lr=3e-4"]
    runs = {
        "local bf16 compile": ["model.backend='local'", "train.compile=true"],
        "fp8 current compile": ["model.backend='fp8'", "train.fp8='current'", "train.compile=true"],
        "fp8 current eager": ["model.backend='fp8'", "train.fp8='current'", "train.compile=false"],
        "fp8 delayed compile": ["model.backend='fp8'", "train.fp8='delayed'", "train.compile=true"],
    }
    for name, overrides in runs.items():
        start = time.time()
        try:
            losses = run_tiny([*common, *overrides], with_grads=False)["losses"]
            print(f"{name:22s} {' '.join(f'{v:.4f}' for v in losses.values())}  ({time.time() - start:.0f} s)")
        except Exception as exc:  # report every run
            print(f"{name:22s} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


if __name__ == "__main__":
    main()
