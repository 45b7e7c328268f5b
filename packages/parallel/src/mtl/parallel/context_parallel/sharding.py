"""Load-balanced sequence sharding for causal attention over the context-parallel group.

With causal attention, a token late in the sequence attends to many more keys than an early
one, so cutting the sequence into ``cp`` contiguous pieces would give the last rank most of
the work. Instead the sequence of length ``s`` is cut into ``2 * cp`` chunks of
``c = s / (2 * cp)`` tokens, and cp rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``
concatenated (Megatron's layout). Every rank then does the same amount of attention work.

    cp = 2, s = 8, chunks [0 1 | 2 3 | 4 5 | 6 7]
    rank 0 holds [0 1 6 7], rank 1 holds [2 3 4 5]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError
from mtl.parallel.topology import Topology


def _check_divisible(seq_length: int, cp: int, what: str) -> int:
    """The chunk length ``s / (2 * cp)``, or a ParallelError saying how to fix ``s``."""
    if seq_length % (2 * cp):
        raise ParallelError(
            f"{what}: sequence length {seq_length} must be divisible by 2 * cp = {2 * cp} for "
            f"load-balanced context parallelism; set data.seq_length to a multiple of {2 * cp}"
        )
    return seq_length // (2 * cp)


def _normalise_dim(tensor: torch.Tensor, seq_dim: int) -> int:
    if not -tensor.dim() <= seq_dim < tensor.dim():
        raise ParallelError(
            f"seq_dim {seq_dim} is out of range for a tensor of shape {tuple(tensor.shape)}"
        )
    return seq_dim % tensor.dim()


def split_for_context_parallel(tensor: torch.Tensor, seq_dim: int, topology: Topology) -> torch.Tensor:
    """This cp rank's part of a full-sequence tensor: chunks ``r`` and ``2cp-1-r`` along ``seq_dim``.

    Shape ``[..., s, ...] -> [..., s / cp, ...]``; returns ``tensor`` itself when cp == 1.
    Differentiable (a slice and a concatenation)."""
    cp = topology.cp
    if cp == 1:
        return tensor
    seq_dim = _normalise_dim(tensor, seq_dim)
    chunk = _check_divisible(tensor.size(seq_dim), cp, "split_for_context_parallel")
    r = topology.cp_rank
    first = tensor.narrow(seq_dim, r * chunk, chunk)
    second = tensor.narrow(seq_dim, (2 * cp - 1 - r) * chunk, chunk)
    return torch.cat([first, second], dim=seq_dim)


def gather_from_context_parallel(tensor: torch.Tensor, seq_dim: int, topology: Topology) -> torch.Tensor:
    """The inverse of :func:`split_for_context_parallel`: the full sequence, in order, on every rank.

    Shape ``[..., s / cp, ...] -> [..., s, ...]``. Collective over the cp group. Meant for
    evaluation and tests: the result carries no autograd history."""
    cp = topology.cp
    if cp == 1:
        return tensor.detach()
    seq_dim = _normalise_dim(tensor, seq_dim)
    local_length = tensor.size(seq_dim)
    if local_length % 2:
        raise ParallelError(
            f"gather_from_context_parallel: local sequence length {local_length} is odd; a "
            "cp rank holds two equal chunks, so pass the tensor split_for_context_parallel returned"
        )
    chunk = local_length // 2
    local = tensor.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local, group=topology.cp_group)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r] = part.narrow(seq_dim, 0, chunk)
        chunks[2 * cp - 1 - r] = part.narrow(seq_dim, chunk, chunk)
    return torch.cat(chunks, dim=seq_dim)


def context_parallel_position_ids(
    seq_length: int, topology: Topology, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions (int64 ``[s / cp]``) of this rank's tokens, for RoPE or learned positions."""
    if topology.cp > 1:
        _check_divisible(seq_length, topology.cp, "context_parallel_position_ids")
    positions = torch.arange(seq_length, dtype=torch.long, device=device)
    return split_for_context_parallel(positions, 0, topology)
