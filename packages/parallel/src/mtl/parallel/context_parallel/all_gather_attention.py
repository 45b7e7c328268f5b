"""Context-parallel attention over all-gathered keys and values (``parallel.cp_comm_type = "all_gather"``).

The ring (``ring_attention.py``) passes k/v blocks between neighbours with point-to-point
sends. Those cannot be traced, so the ring runs eagerly between a compiled layer's graphs,
and its Python and small kernels are what bound the cp=2 step on 2 GPUs (benchmarks/log).
This variant gathers every rank's k/v with one all-gather (its backward is one reduce-scatter
of dK/dV), as Megatron-Core's ``cp_comm_type = "all_gather"`` and Llama 3's context
parallelism do. Both collectives are traceable, so the whole attention compiles with its layer.

What it costs: every rank keeps the whole sequence's k/v for the backward (the ring keeps two
blocks, so about cp/2 times as much; small with grouped-query attention).

Overlap: the own block's pieces need only this rank's k/v, so the forward starts the gather,
computes them from the local k/v, and only then waits; the backward computes the other blocks'
pieces first, starts the reduce-scatter of their dK/dV, computes the own block's, and adds its
dK/dV to what the reduce-scatter returns. The collectives are torch's functional ops, started
and waited on apart: asynchronous on NCCL in eager mode. In a compiled layer inductor decides
the order itself: its peak-memory ordering starts the gather after the own block's kernels.

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
from mtl.parallel.function_output import fresh_output
from mtl.parallel.tensor_parallel.collectives import StartedCollectives

# A piece: (query rows of the local sequence, key rows of a k/v tensor, causal)
Piece = tuple[slice, slice, bool]


def own_and_other_pieces(cp: int, cp_rank: int, s_local: int, causal: bool,
                         fused: bool) -> tuple[list[Piece], list[Piece]]:
    """The block pairs rank ``cp_rank`` computes, as the ring does: (its own block's pieces, keys
    counted in its local k/v; the other ranks' blocks' pieces, keys counted in the gathered,
    rank-order k/v, each rank's block ``s_local`` keys). The own pieces cover every query row,
    in row order (one piece, or three on the einsum path), so the others only merge."""
    block, chunk = s_local, s_local // 2
    own = [(rows, keys, mask_offset == 0)
           for rows, keys, mask_offset in _block_plan(cp_rank, cp_rank, chunk, causal, fused)]
    others = []
    for kv_rank in (j for j in range(cp) if j != cp_rank):
        for rows, keys, mask_offset in _block_plan(cp_rank, kv_rank, chunk, causal, fused):
            # not slice.indices: dynamo under torch 2.11 cannot trace it
            start, stop = keys.start or 0, block if keys.stop is None else keys.stop
            others.append((rows, slice(kv_rank * block + start, kv_rank * block + stop), mask_offset == 0))
    return own, others


def pieces(cp: int, cp_rank: int, s_local: int, causal: bool, fused: bool) -> list[Piece]:
    """Every piece against the gathered k/v (own block first): what one process simulating
    every rank computes (``attention_over_gathered``)."""
    own, others = own_and_other_pieces(cp, cp_rank, s_local, causal, fused)
    offset = cp_rank * s_local
    moved = [(rows, slice(offset + (keys.start or 0), offset + (s_local if keys.stop is None else keys.stop)), masked)
             for rows, keys, masked in own]
    return moved + others


def _forward_pieces(q, kv, plan: list[Piece], out, lse, filled: int, scale: float, kernel: str | None) -> int:
    """Compute ``plan``'s pieces of q against ``kv`` ``[2, b, keys, groups, d]`` into the running
    ``out``/``lse``; returns how many rows are filled (``block_attention.place_piece``)."""
    k, v = kv[0], kv[1]
    for rows, keys, causal in plan:
        if kernel is not None:
            part_out, part_lse = flash_block_forward(q[:, rows], k[:, keys], v[:, keys], scale, causal=causal,
                                                     kernel=kernel)
        else:
            part_out, part_lse = block_forward(q[:, rows], k[:, keys], v[:, keys], scale, 0 if causal else None)
        filled = place_piece(out, lse, filled, rows, part_out, part_lse)
    return filled


def _backward_pieces(dout, delta, q, kv, out, lse, plan: list[Piece], scale: float, kernel: str | None,
                     dq, dkv) -> None:
    """Add ``plan``'s pieces' gradients into ``dq`` and ``dkv`` (shaped like ``kv``). ``delta``
    (rowsum(dO * O), einsum path only) and ``dout`` as ``_backward_inputs`` prepares them."""
    k, v = kv[0], kv[1]
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


def _new_output(q):
    dtype = compute_dtype(q.dtype)
    b, s_local, heads, d = q.shape
    return (torch.empty(b, s_local, heads, d, dtype=dtype, device=q.device),
            torch.empty(b, heads, s_local, dtype=dtype, device=q.device))


def _backward_inputs(dout, q, out, kernel: str | None):
    """(dout, delta) as the pieces' backward reads them: on the fused path dout in q's dtype
    (the kernels compute delta themselves); on the einsum path both in the compute dtype."""
    if kernel is not None:
        return dout.to(q.dtype).contiguous(), None
    dtype = compute_dtype(q.dtype)
    dout = dout.to(dtype)
    return dout, (dout * out.to(dtype)).sum(-1).transpose(1, 2)  # rowsum(dO * O): [b, heads, s]


def _grad_dtype(q, kernel: str | None):
    # on the fused path one piece per key range (module docstring), so the inputs' precision
    # rounds once; the einsum path accumulates in the compute dtype
    return q.dtype if kernel is not None else compute_dtype(q.dtype)


class GatheredKVAttention(torch.autograd.Function):
    """Attention of this rank's queries against already gathered, rank-order k/v
    ``[2, b, S, groups, d]``, every piece after the gather. ``kernel``: "cudnn" or "flash"
    (fused, half precision) or None (einsum in the compute dtype)."""

    @staticmethod
    def forward(ctx, q, kv, plan: list[Piece], scale: float, kernel: str | None):
        out, lse = _new_output(q)
        _forward_pieces(q, kv, plan, out, lse, 0, scale, kernel)
        # filled piece by piece; .to returns it as it is where q is in the compute dtype (fp32)
        out = fresh_output(out.to(q.dtype))
        ctx.save_for_backward(q, kv, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out

    @staticmethod
    @once_differentiable  # built from the final output and log-sum-exp: no graph of its own
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dout, delta = _backward_inputs(dout, q, out, ctx.kernel)
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
        dkv = torch.zeros(kv.shape, dtype=_grad_dtype(q, ctx.kernel), device=kv.device)
        _backward_pieces(dout, delta, q, kv, out, lse, ctx.plan, ctx.scale, ctx.kernel, dq, dkv)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None


def attention_over_gathered(q: torch.Tensor, gathered: torch.Tensor, cp: int, cp_rank: int, causal: bool,
                            scale: float, kernel: str | None) -> torch.Tensor:
    """``q`` ``[b, s_local, heads, d]`` against every rank's k/v, ``gathered`` ``[cp * s_local, 2, b,
    groups, d]`` in rank order (what the all-gather returns); differentiable in both. The
    compute of ``all_gather_attention`` without its collectives: one process can play every rank."""
    kv = gathered.permute(1, 2, 0, 3, 4).contiguous()  # [2, b, S, groups, d], the layout the kernels read
    plan = pieces(cp, cp_rank, q.size(1), causal, fused=kernel is not None)
    return GatheredKVAttention.apply(q, kv, plan, scale, kernel)


class AllGatherAttention(torch.autograd.Function):
    """Attention of this rank's queries against every rank's k/v, the collectives inside and
    overlapped with the own block's pieces (module docstring). ``local`` is this rank's k/v in
    the gather's layout ``[s_local, 2, b, groups, d]``."""

    @staticmethod
    def forward(ctx, q, local, comm: StartedCollectives, causal: bool, scale: float, kernel: str | None):
        own, others = own_and_other_pieces(comm.size, comm.rank, q.size(1), causal, fused=kernel is not None)
        pending = comm.start_gather(local)
        out, lse = _new_output(q)
        own_kv = local.permute(1, 2, 0, 3, 4).contiguous()  # [2, b, s_local, groups, d]
        filled = _forward_pieces(q, own_kv, own, out, lse, 0, scale, kernel)
        kv = comm.finish_gather(pending).permute(1, 2, 0, 3, 4).contiguous()  # [2, b, S, groups, d]
        _forward_pieces(q, kv, others, out, lse, filled, scale, kernel)
        # filled piece by piece; .to returns it as it is where q is in the compute dtype (fp32)
        out = fresh_output(out.to(q.dtype))
        ctx.save_for_backward(q, kv, out, lse)
        ctx.comm, ctx.own, ctx.others, ctx.scale, ctx.kernel = comm, own, others, scale, kernel
        return out

    @staticmethod
    @once_differentiable  # built from the final output and log-sum-exp: no graph of its own
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        comm, kernel = ctx.comm, ctx.kernel
        dout, delta = _backward_inputs(dout, q, out, kernel)
        dq = torch.zeros(q.shape, dtype=compute_dtype(q.dtype), device=q.device)
        grad_dtype = _grad_dtype(q, kernel)
        # the other blocks' dK/dV first (this rank's slot stays zero), summed over the ranks
        # while the own block's backward runs
        dkv = torch.zeros(kv.shape, dtype=grad_dtype, device=kv.device)
        _backward_pieces(dout, delta, q, kv, out, lse, ctx.others, ctx.scale, kernel, dq, dkv)
        pending = comm.start_reduce_scatter(dkv.permute(2, 0, 1, 3, 4).contiguous())  # the gather's layout
        s_local = q.size(1)
        own_kv = kv[:, :, comm.rank * s_local:(comm.rank + 1) * s_local]
        own_dkv = torch.zeros(own_kv.shape, dtype=grad_dtype, device=kv.device)
        _backward_pieces(dout, delta, q, own_kv, out, lse, ctx.own, ctx.scale, kernel, dq, own_dkv)
        dlocal = comm.finish_reduce_scatter(pending) + own_dkv.permute(2, 0, 1, 3, 4)
        return dq.to(q.dtype), dlocal.to(kv.dtype), None, None, None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology, causal: bool, scale: float,
                         kernel: str | None) -> torch.Tensor:
    """Context-parallel attention with k/v all-gathered over the cp group (module docstring)."""
    local = torch.stack([k, v], dim=1).transpose(0, 2).contiguous()  # [s_local, 2, b, groups, d]
    return AllGatherAttention.apply(q, local, StartedCollectives(topology.cp_group), causal, scale, kernel)
