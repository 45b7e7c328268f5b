"""RMSNorm on a GPU: errors vs an fp32 reference and time per call, F.rms_norm vs the Triton op.

    python3 benchmarks/gpu/rms_norm_check.py [--seq 2048 --batch 4 --hidden 2048 --iters 50]

For each of F.rms_norm eager / compiled and the Triton op (mtl::rms_norm_fwd/bwd) eager /
compiled, at x [seq, batch, hidden] bf16 with a bf16 weight: the max abs error of y, dx and
dweight against F.rms_norm computed in fp32 on the same inputs, and the median time per call
(torch.cuda.Event, after warm-up; L2 flushed and the GPU kept busy before each timed call so
CPU launch overhead is not timed) of the forward and of the backward (torch.autograd.grad of
y with dy, so no .grad accumulation is timed). A case that fails prints one FAIL line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

try:
    from mtl.parallel.backend_local import rms_norm_kernel as K
except Exception:  # noqa: BLE001 -- not installed: use the checkout's sources
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    for pkg in ("core", "parallel"):
        sys.path.insert(0, os.path.join(root, "packages", pkg, "src"))
    from mtl.parallel.backend_local import rms_norm_kernel as K


def f_rms_norm(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def triton_rms_norm(x, w, eps):
    return K.triton_rms_norm(x, w, eps)


_FLUSH = None


def _before_timing():
    """Untimed: evict L2 (write 256 MB), then keep the GPU busy ~1 ms so the timed launches are
    queued before it reaches them (the time is the GPU's, not the CPU's launch overhead)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)


def median_ms(fn, iters, warmup=10, setup=None):
    """Median GPU time of fn(setup()) over iters calls; setup (untimed) builds fn's argument."""
    for _ in range(warmup):
        fn(setup() if setup is not None else None)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        arg = setup() if setup is not None else None
        _before_timing()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(name, fn, x, w, dy, eps, ref, iters):
    y_ref, dx_ref, dw_ref = ref
    y = fn(x, w, eps)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    torch.cuda.synchronize()
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype, (y.dtype, dx.dtype, dw.dtype)
    err_y = (y.float() - y_ref).abs().max().item()
    err_dx = (dx.float() - dx_ref).abs().max().item()
    err_dw = (dw.float() - dw_ref).abs().max().item()
    rel_dw = err_dw / max(dw_ref.abs().max().item(), 1e-30)

    fwd_ms = median_ms(lambda _: fn(x, w, eps), iters)
    # backward: a fresh forward (untimed) before each timed torch.autograd.grad
    bwd_ms = median_ms(lambda y_: torch.autograd.grad(y_, (x, w), dy), iters, setup=lambda: fn(x, w, eps))
    print(
        f"{name:<22} fwd {fwd_ms:7.4f} ms  bwd {bwd_ms:7.4f} ms  "
        f"max|err| y {err_y:.3e} dx {err_dx:.3e} dw {err_dw:.3e} (rel {rel_dw:.2e})",
        flush=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--eps", type=float, default=1e-5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    print(f"torch {torch.__version__} device {torch.cuda.get_device_name(0)} triton available {K.HAVE_TRITON}")
    torch.manual_seed(0)
    shape = (args.seq, args.batch, args.hidden)
    x = torch.randn(shape, device="cuda").bfloat16().requires_grad_()
    w = (1 + 0.2 * torch.randn(args.hidden, device="cuda")).bfloat16().requires_grad_()
    dy = torch.randn(shape, device="cuda").bfloat16()
    print(f"x {list(shape)} bf16, weight [{args.hidden}] bf16, eps {args.eps}, median of {args.iters}")
    print(f"Triton path applies: {K.can_use_triton_rms_norm(x, w)}")

    # fp32 reference on the same (bf16-rounded) inputs
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y_ref = F.rms_norm(xr, (args.hidden,), wr, args.eps)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xr, wr), dy.float())
    ref = (y_ref.detach(), dx_ref, dw_ref)
    print(
        f"{'(rounding the ref)':<22} max|err| y {(y_ref.bfloat16().float() - y_ref).abs().max().item():.3e} "
        f"dx {(dx_ref.bfloat16().float() - dx_ref).abs().max().item():.3e} "
        f"dw {(dw_ref.bfloat16().float() - dw_ref).abs().max().item():.3e}"
    )
    nbytes = 3 * x.numel() * x.element_size()
    print(f"backward moves >= {nbytes / 1e6:.1f} MB (read x, dy; write dx): {nbytes / 3.35e12 * 1e3:.4f} ms at 3.35 TB/s")
    del xr, wr, y_ref

    cases = [
        ("F.rms_norm eager", lambda: f_rms_norm),
        ("F.rms_norm compiled", lambda: torch.compile(f_rms_norm)),
        ("triton eager", lambda: triton_rms_norm),
        ("triton compiled", lambda: torch.compile(triton_rms_norm, fullgraph=True)),
    ]
    failures = 0
    for name, make in cases:
        try:
            torch._dynamo.reset()
            run_case(name, make(), x, w, dy, args.eps, ref, args.iters)
        except Exception as e:  # noqa: BLE001 -- one line per failed case, then go on
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            traceback.print_exc(limit=3)
        finally:
            torch.cuda.synchronize()
    print(f"done, {failures} failed case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
