"""Ring attention over the context-parallel group, forward and exact backward.

Each cp rank holds its load-balanced share of the sequence (see ``sharding.py``): two chunks
of ``c`` tokens, ``r`` and ``2cp-1-r``. Key/value blocks travel around the ring
(rank r sends to r+1, receives from r-1) with async p2p while the block in hand is computed;
at step ``i`` rank ``r`` holds the keys/values of rank ``j = (r - i) mod cp``. The causal mask
of a (query rank r, key rank j) pair follows from the chunk order
``j < r < 2cp-1-r < 2cp-1-j`` (for j < r) and ``r < j, 2cp-1-j < 2cp-1-r`` (for j > r):

    j == r: lower-triangular over the local sequence: each q chunk against its own k/v chunk
            (causal), the second q chunk against the first k/v chunk (full), the first q
            chunk against the second k/v chunk masked. The two chunks are in global order, so
            that is plain causal attention over the local 2c tokens: one square causal piece on
            the fused kernels (one call and no merge, where three pieces took three and a
            merge); the einsum path keeps the three pieces (it would compute and hold the
            masked quarter)
    j <  r: both chunks of q against the first chunk of k/v, no mask (the second is in the future)
    j >  r: the second chunk of q against both chunks of k/v, no mask (the first q chunk is earlier)

The forward keeps a running output and log-sum-exp per query row: the first piece of a row
range (on step 0, the diagonal block, which covers every row) is copied in as it is, and only
later pieces are merged (``merge_partial_into``): a merge is several small kernels, and the
ring's host time (launches) is what bounds it at cp=2.

The backward pass runs the ring the other way (k/v and dK/dV go to the previous rank), in
the reverse order of blocks: ``r+1, r+2, ..., r-1``, then the rank's own. The forward keeps the
last block it received, rank r+1's, so the backward starts computing at once, with no
transfer to wait for. Each block's dK/dV accumulator travels with it, collecting every
rank's contribution. The own block comes last, so its accumulator arrives from the next rank
while the diagonal block is computed, and no hop is left after the loop. That is cp-2 k/v
transfers and cp-1 dK/dV transfers, against cp-1 and cp for a ring that restarts from the
own block. At cp = 2 the only transfer left is one dK/dV accumulator, sent while the
diagonal block is computed. Kept for backward: q, the stacked k/v of this rank and of rank r+1 (one k/v
block more than the inputs), the output and the log-sum-exp.

Every piece is a full block or a square causal one, so on CUDA in bf16/fp16 the pieces run on
fused attention kernels (``flash_blocks.py``: cuDNN's on Hopper, else FlashAttention-2);
elsewhere on the einsum path. On the fused path the travelling dK/dV accumulator is in the
inputs' half precision, not fp32: that halves the backward's transfer bytes, for one rounding per piece added into it (about cp + 1 per block; the
kernels' gradients are half precision already), as Transformer Engine's ring does. The einsum
path accumulates in the compute dtype (fp32 or wider) and stays exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mtl.parallel.context_parallel.block_attention import (
    block_backward,
    block_forward,
    compute_dtype,
    place_piece,
)
from mtl.parallel.context_parallel.flash_blocks import (
    flash_block_backward,
    flash_block_forward,
    fused_kernel,
)
from mtl.parallel.function_output import fresh_output
from mtl.parallel.topology import Topology

# Distinct tags keep the k/v and dK/dV messages apart on backends that match by tag (gloo).
_KV_TAG = 1
_DKV_TAG = 2


class CpRing:
    """This rank's place in the cp ring: global ranks of its neighbours and the group."""

    def __init__(self, topology: Topology):
        self.size = topology.cp
        self.rank = topology.cp_rank
        self.group = topology.cp_group
        ranks = topology.group_ranks["cp"]  # sorted, so index == cp coordinate
        self.next_global = ranks[(self.rank + 1) % self.size]
        self.prev_global = ranks[(self.rank - 1) % self.size]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, backward: bool = False) -> list:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one
        (``backward``: to the previous rank, from the next one)."""
        to, source = (self.prev_global, self.next_global) if backward else (self.next_global, self.prev_global)
        ops = [
            dist.P2POp(dist.isend, send, to, self.group, tag),
            dist.P2POp(dist.irecv, recv, source, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)


def _block_plan(q_rank: int, kv_rank: int, chunk: int, causal: bool,
                fused: bool = True) -> list[tuple[slice, slice, int | None]]:
    """The pieces of one block pair to compute: (query rows, key rows, mask offset) of the local
    sequence, the mask offset as ``block_attention`` reads it (None: no mask, 0: square causal).
    ``fused``: the pieces run on fused kernels, which skip a causal piece's masked tiles; the
    einsum path would compute (and hold) them, so it takes the diagonal block in three pieces."""
    everything = slice(None)
    first, second = slice(0, chunk), slice(chunk, 2 * chunk)
    if not causal:
        return [(everything, everything, None)]
    if kv_rank == q_rank and fused:  # the local chunks are in global order: causal over all 2c tokens
        return [(everything, everything, 0)]
    if kv_rank == q_rank:
        return [(first, first, 0), (second, first, None), (second, second, 0)]
    if kv_rank < q_rank:
        return [(everything, first, None)]
    return [(second, everything, None)]


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Autograd function of ring attention; call through ``context_parallel_attention``."""

    @staticmethod
    def forward(ctx, q, k, v, ring: CpRing, causal: bool, scale: float):
        b, s_local, heads, d = q.shape
        chunk = s_local // 2
        dtype = compute_dtype(q.dtype)
        out = torch.empty(b, s_local, heads, d, dtype=dtype, device=q.device)
        lse = torch.empty(b, heads, s_local, dtype=dtype, device=q.device)
        filled = 0  # rows [0, filled) of out/lse hold a result; the plans list pieces in row order
        kv = torch.stack([k, v]).contiguous()  # [2, b, s_local, groups, d]; this rank's own, for backward
        block = kv  # the k/v block in hand
        kernel = fused_kernel(q.device, q.dtype, q.size(-1))
        fused = kernel is not None
        for step in range(ring.size):
            kv_rank = (ring.rank - step) % ring.size
            pending, next_block = [], None
            if step < ring.size - 1:  # start the next block's transfer before computing this one
                next_block = torch.empty_like(block)
                pending = ring.exchange(block, next_block, _KV_TAG)
            for rows, keys, mask_offset in _block_plan(ring.rank, kv_rank, chunk, causal, fused):
                if fused:
                    part_out, part_lse = flash_block_forward(
                        q[:, rows], block[0][:, keys], block[1][:, keys], scale,
                        causal=mask_offset == 0, kernel=kernel,
                    )
                else:
                    part_out, part_lse = block_forward(
                        q[:, rows], block[0][:, keys], block[1][:, keys], scale, mask_offset
                    )
                filled = place_piece(out, lse, filled, rows, part_out, part_lse)
            _wait(pending)
            if next_block is not None:
                block = next_block
        # filled piece by piece; .to returns it as it is where q is in the compute dtype (fp32)
        out = fresh_output(out.to(q.dtype))
        # block: the last one received, rank r+1's (this rank's own at cp = 1), where backward starts
        ctx.save_for_backward(q, kv, block, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        ctx.kernel = kernel  # backward runs the forward's kernel, whatever the SDPA switches are then
        return out

    @staticmethod
    @once_differentiable  # the ring's p2p buffers carry no graph: refuse double backward loudly
    def backward(ctx, dout):
        q, kv, last_block, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        chunk = q.size(1) // 2
        dtype = compute_dtype(q.dtype)
        kernel = ctx.kernel
        fused = kernel is not None
        if fused:
            dout = dout.to(q.dtype).contiguous()
        else:
            dout = dout.to(dtype)
            # delta = rowsum(dO * O): [b, s_local, heads] -> [b, heads, s_local]
            delta = (dout * out.to(dtype)).sum(-1).transpose(1, 2)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        # The kernels' dk/dv pieces are half precision already; a half-precision accumulator
        # halves the bytes sent around the ring (see the module docstring).
        dkv_dtype = q.dtype if fused else dtype
        block = last_block  # rank r+1's k/v, kept by the forward: no transfer to wait for first
        dkv_pending: list = []
        dkv_arrived = None  # the accumulator of the block in hand, from the next rank
        for step in range(ring.size):
            kv_rank = (ring.rank + 1 + step) % ring.size  # r+1, r+2, ..., r-1, then this rank's own
            kv_pending, next_block = [], None
            if step < ring.size - 2:  # pass the block on to the previous rank; the last one is our own
                next_block = torch.empty_like(block)
                kv_pending = ring.exchange(block, next_block, _KV_TAG, backward=True)
            kv_grads = []  # (key rows, dk part, dv part), added once the accumulator arrives
            for rows, keys, mask_offset in _block_plan(ring.rank, kv_rank, chunk, causal, fused):
                if fused:
                    dq_part, dk_part, dv_part = flash_block_backward(
                        dout[:, rows], out[:, rows], q[:, rows], block[0][:, keys], block[1][:, keys],
                        lse[:, :, rows], scale, causal=mask_offset == 0, kernel=kernel,
                    )
                else:
                    dq_part, dk_part, dv_part = block_backward(
                        dout[:, rows], delta[:, :, rows], q[:, rows], block[0][:, keys], block[1][:, keys],
                        lse[:, :, rows], scale, mask_offset,
                    )
                dq[:, rows] += dq_part
                kv_grads.append((keys, dk_part, dv_part))
            _wait(dkv_pending)  # the next rank's accumulator for this block arrived during the compute
            # [2, b, s_local, groups, d]: dK and dV of block kv_rank, summed over the ranks before
            dkv = dkv_arrived if dkv_arrived is not None else kv.new_zeros(kv.shape, dtype=dkv_dtype)
            for keys, dk_part, dv_part in kv_grads:
                dkv[0][:, keys] += dk_part
                dkv[1][:, keys] += dv_part
            if step < ring.size - 1:  # on to the previous rank, which takes this block next
                dkv_arrived = torch.empty_like(dkv)
                dkv_pending = ring.exchange(dkv, dkv_arrived, _DKV_TAG, backward=True)
            _wait(kv_pending)
            block = next_block if next_block is not None else kv
        # the last step was this rank's own block: dkv holds every rank's share of it
        dk, dv = dkv[0].to(kv.dtype), dkv[1].to(kv.dtype)  # k and v share q's dtype
        return dq.to(q.dtype), dk, dv, None, None, None
