"""Ring attention's compute on one GPU, without the exchange (issue 11, context parallelism):
what one cp rank computes per layer, on the fused-kernel blocks (the ring's choice, cuDNN on
Hopper; and FlashAttention-2) against the einsum blocks, beside one GPU's SDPA over the whole
sequence.

    python3 benchmarks/gpu/cp_blocks_bench.py [--seq 8192] [--cp 2] [--batch 2] [--heads 16] [--iters 10]

``RingAttention`` runs with a loopback ring: each "exchange" copies the block the rank sends
into the buffer it receives (one device, no peer), so the rank computes exactly the block pairs
of its real ring position (``--rank``; every rank by default). Times are forward + backward per
call, in ms (CUDA events, mean of ``--iters``). The ideal for cp ranks is the full-sequence
SDPA time divided by cp. The last two columns are ``parallel.cp_comm_type = "all_gather"``'s
attention against a gathered k/v (eager, and compiled with ``fullgraph=True``), without the
all-gather itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mtl.parallel.context_parallel.flash_blocks import fused_kernel
from mtl.parallel.context_parallel.ring_attention import RingAttention
from profile_step import cuda_ms_per_call, kernels_per_call


class LoopbackRing:
    """A cp ring position on one device: ``exchange`` copies instead of sending."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, backward: bool = False) -> list:
        recv.copy_(send)  # either direction: the block comes back to this device
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also list the flash path's kernels (rank 0)")
    args = ap.parse_args()
    b, h, d, s_local = args.batch, args.heads, args.head_dim, args.seq // args.cp
    scale = d ** -0.5
    dtype = torch.bfloat16

    def make(s):
        return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]

    q, k, v = make(args.seq)
    dout = torch.randn_like(q)

    def full():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale)
        out.transpose(1, 2).backward(dout)

    full_ms = cuda_ms_per_call(full, args.iters)
    print(f"seq {args.seq}, batch {b}, heads {h}, head dim {d}, bf16, {torch.cuda.get_device_name()}")
    print(f"one GPU, SDPA over the whole sequence: {full_ms:.2f} ms fwd+bwd; ideal per cp rank: "
          f"{full_ms / args.cp:.2f} ms")
    print("| cp rank | ring's kernel | its blocks ms | FlashAttention-2 blocks ms | einsum blocks ms | ring / ideal "
          "| all-gathered k/v, eager ms | all-gathered k/v, compiled ms |")
    print("|---|---|---|---|---|---|---|---|")
    ql, kl, vl = make(s_local)
    dl = torch.randn_like(ql)
    for rank in ([args.rank] if args.rank is not None else range(args.cp)):
        ring = LoopbackRing(args.cp, rank)

        def ring_step():
            RingAttention.apply(ql, kl, vl, ring, True, scale).backward(dl)

        flash_ms = cuda_ms_per_call(ring_step, args.iters)  # the ring's own choice of kernel (fused_kernel)
        import mtl.parallel.context_parallel.ring_attention as ring_module
        chosen = ring_module.fused_kernel
        try:
            ring_module.fused_kernel = lambda *_: "flash"  # FlashAttention-2, for comparison
            fa2_ms = cuda_ms_per_call(ring_step, args.iters)
            ring_module.fused_kernel = lambda *_: None  # the einsum path, for comparison
            einsum_ms = cuda_ms_per_call(ring_step, max(2, args.iters // 5))
        finally:
            ring_module.fused_kernel = chosen
        gathered_ms = [cuda_ms_per_call(step, args.iters) for step in gathered_steps(ql, kl, vl, dl, args.cp, rank, scale)]
        print(f"| {rank} | {chosen(ql.device, ql.dtype, ql.size(-1))} | {flash_ms:.2f} | {fa2_ms:.2f} | {einsum_ms:.2f} "
              f"| {flash_ms / (full_ms / args.cp):.2f}x | {gathered_ms[0]:.2f} | {gathered_ms[1]:.2f} |")
        if args.profile and rank == 0:
            profiled = kernel_table(ring_step)
    if args.profile:
        print("\nflash path, cp rank 0, kernels per call (ms, launches):")
        print(profiled)


def gathered_steps(q, k, v, dout, cp: int, rank: int, scale: float) -> list:
    """``cp_comm_type = "all_gather"``'s attention for this rank, eager and compiled, on a gathered
    k/v of cp copies of this rank's (the all-gather itself, a collective, is not timed here)."""
    from mtl.parallel.context_parallel.all_gather_attention import attention_over_gathered

    kernel = fused_kernel(q.device, q.dtype, q.size(-1))
    local = torch.stack([k.detach(), v.detach()], dim=1).transpose(0, 2)
    gathered = torch.cat([local] * cp).requires_grad_()
    compiled = torch.compile(attention_over_gathered, fullgraph=True, dynamic=False)
    return [lambda fn=fn: fn(q, gathered, cp, rank, True, scale, kernel).backward(dout)
            for fn in (attention_over_gathered, compiled)]


def kernel_table(fn, calls: int = 5, rows: int = 20) -> str:
    events = kernels_per_call(fn, calls, warmup=1)
    total = sum(ms for _, ms, _ in events)
    lines = [f"total {total:.3f} ms"] + [f"  {ms:7.3f}  x{n:<4d} {key[:100]}" for key, ms, n in events[:rows]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
