"""Context-parallel attention over all-gathered keys and values (``parallel.cp_comm_type = "all_gather"``).

The ring (``ring_attention.py``) passes k/v blocks between neighbours with point-to-point
sends. Those cannot be traced, so the ring runs eagerly between a compiled layer's graphs,
and its Python and small kernels are what bound the cp=2 step on 2 GPUs (benchmarks/RESULTS.md).
This variant gathers every rank's k/v with one all-gather (its backward is one reduce-scatter
of dK/dV), as Megatron-Core's ``cp_comm_type = "all_gather"`` and Llama 3's context
parallelism do. Both collectives are traceable, so the whole attention compiles with its layer.

What it costs: every rank keeps the whole sequence's k/v for the backward (the ring keeps two
blocks, so about cp/2 times as much; small with grouped-query attention), and the gather is not
overlapped with attention compute (it happens between the QKV projection and attention).

The gathered k/v stay in rank order: rank ``j``'s block is its two chunks, ``j`` and
``2cp-1-j``. Rank ``r`` computes the same block pairs the ring computes
(``ring_attention._block_plan``): its own block as one causal piece over its 2c tokens, the
blocks of lower ranks against both its query chunks, those of higher ranks against its
second. That is cp fused-kernel calls per direction (no reordering copy), and every key of
this rank's view is computed by one piece on the fused path, so dK/dV take one rounding in the
inputs' precision there (as the ring sends them); the einsum path keeps the diagonal block in
three pieces and accumulates in the compute dtype. The all-gather's backward then sums dK/dV
over the ranks.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mtl.parallel.context_parallel.block_attention import (
    block_backward,
    block_forward,
    compute_dtype,
    place_piece,
)
from mtl.parallel.context_parallel.flash_blocks import flash_block_backward, flash_block_forward
from mtl.parallel.context_parallel.ring_attention import _block_plan
from mtl.parallel.tensor_parallel.mappings import gather_from_sequence_parallel

# A piece: (query rows of the local sequence, key rows of the gathered sequence, causal)
Piece = tuple[slice, slice, bool]


def pieces(cp: int, cp_rank: int, s_local: int, causal: bool, fused: bool) -> list[Piece]:
    """The block pairs rank ``cp_rank`` computes against the gathered, rank-order k/v (each
    rank's block ``s_local`` keys): its own block first (it covers every query row, in one
    piece or, on the einsum path, three), then the others in rank order."""
    block, chunk = s_local, s_local // 2
    plan = []
    for kv_rank in [cp_rank, *(j for j in range(cp) if j != cp_rank)]:
        for rows, keys, mask_offset in _block_plan(cp_rank, kv_rank, chunk, causal, fused):
            # not slice.indices: dynamo under torch 2.11 cannot trace it
            start, stop = keys.start or 0, block if keys.stop is None else keys.stop
            plan.append((rows, slice(kv_rank * block + start, kv_rank * block + stop), mask_offset == 0))
    return plan


class GatheredKVAttention(torch.autograd.Function):
    """Attention of this rank's queries against the gathered, rank-order k/v
    ``[2, b, S, groups, d]``. ``kernel``: "cudnn" or "flash" (fused, half precision) or None
    (einsum in the compute dtype)."""

    @staticmethod
    def forward(ctx, q, kv, plan: list[Piece], scale: float, kernel: str | None):
        dtype = compute_dtype(q.dtype)
        k, v = kv[0], kv[1]
        b, s_local, heads, d = q.shape
        out = torch.empty(b, s_local, heads, d, dtype=dtype, device=q.device)
        lse = torch.empty(b, heads, s_local, dtype=dtype, device=q.device)
        filled = 0  # as the ring: the own block's pieces cover the rows in order, later ones merge
        for rows, keys, causal in plan:
            if kernel is not None:
                part_out, part_lse = flash_block_forward(q[:, rows], k[:, keys], v[:, keys], scale, causal=causal,
                                                         kernel=kernel)
            else:
                part_out, part_lse = block_forward(q[:, rows], k[:, keys], v[:, keys], scale, 0 if causal else None)
            filled = place_piece(out, lse, filled, rows, part_out, part_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out

    @staticmethod
    @once_differentiable  # built from the final output and log-sum-exp: no graph of its own
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        plan, scale, kernel = ctx.plan, ctx.scale, ctx.kernel
        dtype = compute_dtype(q.dtype)
        k, v = kv[0], kv[1]
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        # on the fused path one piece per key range (module docstring), so the inputs' precision
        # rounds once; the einsum path accumulates in the compute dtype
        dkv = torch.zeros(kv.shape, dtype=q.dtype if kernel is not None else dtype, device=kv.device)
        if kernel is not None:
            dout = dout.to(q.dtype).contiguous()
        else:
            dout = dout.to(dtype)
            delta = (dout * out.to(dtype)).sum(-1).transpose(1, 2)  # rowsum(dO * O): [b, heads, s]
        for rows, keys, causal in plan:
            if kernel is not None:
                dq_part, dk_part, dv_part = flash_block_backward(
                    dout[:, rows], out[:, rows], q[:, rows], k[:, keys], v[:, keys], lse[:, :, rows], scale,
                    causal=causal, kernel=kernel,
                )
            else:
                dq_part, dk_part, dv_part = block_backward(
                    dout[:, rows], delta[:, :, rows], q[:, rows], k[:, keys], v[:, keys], lse[:, :, rows], scale,
                    0 if causal else None,
                )
            dq[:, rows] += dq_part
            # added, not written: the einsum path's diagonal block has two pieces on its first chunk
            dkv[0][:, keys] += dk_part
            dkv[1][:, keys] += dv_part
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None


def attention_over_gathered(q: torch.Tensor, gathered: torch.Tensor, cp: int, cp_rank: int, causal: bool,
                            scale: float, kernel: str | None) -> torch.Tensor:
    """``q`` ``[b, s_local, heads, d]`` against every rank's k/v, ``gathered`` ``[cp * s_local, 2, b,
    groups, d]`` in rank order (what the all-gather returns); differentiable in both."""
    kv = gathered.permute(1, 2, 0, 3, 4).contiguous()  # [2, b, S, groups, d], the layout the kernels read
    plan = pieces(cp, cp_rank, q.size(1), causal, fused=kernel is not None)
    return GatheredKVAttention.apply(q, kv, plan, scale, kernel)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology, causal: bool, scale: float,
                         kernel: str | None) -> torch.Tensor:
    """Context-parallel attention with k/v all-gathered over the cp group (module docstring)."""
    local = torch.stack([k, v], dim=1).transpose(0, 2)  # [s_local, 2, b, groups, d]
    # backward: each rank's dK/dV summed over the ranks that attended to it (reduce-scatter)
    gathered = gather_from_sequence_parallel(local.contiguous(), topology.cp_group, grad_is_partial=True)
    return attention_over_gathered(q, gathered, topology.cp, topology.cp_rank, causal, scale, kernel)
