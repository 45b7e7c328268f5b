"""Causal attention kernels on one GPU at the reference model's shape (issue 11): which kernel
should a layer's core attention run?

    python3 benchmarks/gpu/attention_bench.py [--batch 4] [--seq 2048] [--heads 16] [--head-dim 128]

Rows, each forward + backward of q, k, v in the layer's ``[b, s, heads, d]`` layout (bf16):
- ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` on cuDNN's fused kernel (SDPA's choice on Hopper);
- ``sdpa-flash2``: the same call on PyTorch's built-in FlashAttention-2;
- ``fa4``: FlashAttention-4 (``flash_attn.cute``, CuTe DSL; its Hopper path follows FA3) called directly,
  when the package is importable;
- ``sdpa-fa4``: SDPA with FA4 registered as its flash kernel (``train.attention_kernel = "fa4"``,
  mtl.parallel.backend_local.fa4: the route that composes with ``torch.compile``);
- ``compiled ...``: the SDPA rows inside ``torch.compile`` (transposes and all).

Times are CUDA events (mean of ``--iters``); TFLOP/s counts the causal half (forward 2 GEMMs, backward
2.5x the forward). Each row's error is the largest absolute difference of its output and input
gradients from an fp32 reference (math SDPA on fp32 copies), beside cuDNN's.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from profile_step import cuda_ms_per_call, kernels_per_call


def sdpa_bshd(q, k, v):
    """The layer's call: [b, s, h, d] in and out, SDPA in [b, h, s, d]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def fa4_bshd(q, k, v):
    from flash_attn.cute.interface import flash_attn_func

    out = flash_attn_func(q, k, v, causal=True)
    return out[0] if isinstance(out, tuple) else out


def fwd_bwd(attend, q, k, v, dout, backend=None):
    def call():
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with ctx:
            out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return out, grads

    return call


def errors(call, ref) -> str:
    out, grads = call()
    diffs = [(a.float() - b).abs().max().item() for a, b in zip((out, *grads), ref)]
    return " / ".join(f"{d:.2e}" for d in diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--kernels", action="store_true", help="print each row's kernels")
    args = parser.parse_args()

    torch.manual_seed(0)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out32 = sdpa_bshd(q32, k32, v32)
    ref = (out32.detach(), *torch.autograd.grad(out32, (q32, k32, v32), dout.float()))
    del q32, k32, v32, out32

    flops = 4 * b * h * s * s * d / 2 * 3.5  # causal half; backward 2.5x the forward
    rows = [
        ("sdpa-cudnn", fwd_bwd(sdpa_bshd, q, k, v, dout, SDPBackend.CUDNN_ATTENTION)),
        ("sdpa-flash2", fwd_bwd(sdpa_bshd, q, k, v, dout, SDPBackend.FLASH_ATTENTION)),
        ("compiled sdpa-cudnn", fwd_bwd(torch.compile(sdpa_bshd), q, k, v, dout, SDPBackend.CUDNN_ATTENTION)),
    ]
    try:
        import flash_attn.cute.interface  # noqa: F401

        rows.append(("fa4", fwd_bwd(fa4_bshd, q, k, v, dout)))
    except ImportError as exc:
        print(f"fa4: not importable ({exc})")
    results = []

    def measure(name, call):
        # the kernel table now, not at the end: FA4's registration below replaces the flash kernels
        kernels = kernels_per_call(call)[:8] if args.kernels else []
        results.append((name, cuda_ms_per_call(call, iters=args.iters), errors(call, ref), kernels))
        print(f"{name}: {results[-1][1]:.3f} ms, errors {results[-1][2]}", flush=True)

    for name, call in rows:
        measure(name, call)
    if any(name == "fa4" for name, _ in rows):
        from mtl.parallel.backend_local.fa4 import activate_fa4

        activate_fa4(q.device)  # also off: AOTAutograd's cache, which would return the cuDNN graph
        torch._dynamo.reset()  # the compiled row above traced SDPA to cuDNN's op
        measure("sdpa-fa4", fwd_bwd(sdpa_bshd, q, k, v, dout, SDPBackend.FLASH_ATTENTION))
        measure("compiled sdpa-fa4", fwd_bwd(torch.compile(sdpa_bshd), q, k, v, dout, SDPBackend.FLASH_ATTENTION))

    print(f"\nb={b} s={s} heads={h} d={d} causal bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| kernel | ms fwd+bwd | TFLOP/s | max error out / dq / dk / dv (fp32 reference) |")
    print("|---|---|---|---|")
    for name, ms, err, _ in results:
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err} |")
    for name, _, _, kernels in results:
        if kernels:
            print(f"\n{name}:")
            for kernel, ms, launches in kernels:
                print(f"  {ms:8.3f} ms x{launches}  {kernel[:110]}")

if __name__ == "__main__":
    main()
