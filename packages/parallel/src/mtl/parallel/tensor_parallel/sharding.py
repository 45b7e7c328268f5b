"""The shard arithmetic of tensor parallelism, in one place.

A TP parameter holds a contiguous slice of its global tensor along its ``ParamLayout.tp_split_dim``. With
``stride > 1`` (a fused weight such as QKV, or gate/up of SwiGLU) the global dimension is
first cut into ``stride`` equal blocks and each rank holds its slice *of every block*, so each
rank keeps whole heads of Q, K and V instead of "all of Q" on rank 0.
"""

from __future__ import annotations

import torch

from mtl.core.errors import ParallelError


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, or a ParallelError naming the quantity that does not split."""
    if numerator % denominator:
        raise ParallelError(
            f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"choose parallel.tp to divide it"
        )
    return numerator // denominator


def tp_size_and_rank(topology) -> tuple[int, int, object]:
    """(tp, tp_rank, tp_group) of ``topology``; (1, 0, None) when it is None."""
    if topology is None:
        return 1, 0, None
    return topology.tp, topology.tp_rank, topology.tp_group


def shard_of(full: torch.Tensor, dim: int, tp: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice of a global tensor: [.., n, ..] -> [.., n/tp, ..]."""
    if full.shape[dim] % (tp * stride):
        raise ParallelError(
            f"dimension {dim} of a tensor of shape {tuple(full.shape)} does not split into "
            f"tp*stride = {tp}*{stride} equal parts"
        )
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[tp_rank] for b in blocks], dim=dim).contiguous()


def full_from_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of ``shard_of`` given every rank's slice, in TP-rank order."""
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_rank_blocks[r][b] for b in range(stride) for r in range(len(shards))], dim=dim)
