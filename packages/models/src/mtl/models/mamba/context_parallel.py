"""Context parallelism of the Mamba-2 mixer: the convolution and the scan need the whole sequence,
so around them each cp rank trades its part of the sequence for a share of the heads (Megatron's
scheme): an all-to-all turns ``[s/cp, b, groups, ...]`` (every local group, this rank's tokens)
into ``[s, b, groups/cp, ...]`` (every token, this rank's groups), and a second one turns the
mixer's output back. The tokens a cp rank holds are chunks ``r`` and ``2cp - 1 - r`` of ``2cp``
(``mtl.parallel.context_parallel.sharding``): the gathered sequence is put back in order before
the convolution, and out of order after. Both exchanges are differentiable (their backward is the
reverse exchange)."""

from __future__ import annotations

import torch

from mtl.parallel.expert_parallel import all_to_all


def _rank_major_chunks(cp: int) -> list[int]:
    """The sequence chunks in the order the cp ranks hold them: rank 0's two, rank 1's two, ..."""
    return [chunk for rank in range(cp) for chunk in (rank, 2 * cp - 1 - rank)]


def to_head_sharded(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """``[s/cp, b, G, W]`` (this rank's tokens, all G groups) -> ``[s, b, G/cp, W]`` (all tokens in
    order, the groups of this cp rank: the r-th G/cp of them)."""
    s_local, batch, groups, width = local.shape
    # [s/cp, b, cp, G/cp, W] -> [cp (destination), s/cp, b, G/cp, W]: block j goes to rank j
    outgoing = local.view(s_local, batch, cp, groups // cp, width).movedim(2, 0).reshape(cp * s_local, batch, -1, width)
    gathered = all_to_all(outgoing, [s_local] * cp, [s_local] * cp, group)  # block i: rank i's tokens
    order = _rank_major_chunks(cp)
    chunks = gathered.view(2 * cp, s_local // 2, batch, groups // cp, width)
    in_order = torch.stack([chunks[order.index(k)] for k in range(2 * cp)])  # natural chunk order
    return in_order.reshape(cp * s_local, batch, groups // cp, width)


def to_sequence_sharded(full: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of ``to_head_sharded``: ``[s, b, G/cp, W]`` -> ``[s/cp, b, G, W]``."""
    s, batch, local_groups, width = full.shape
    s_local = s // cp
    chunks = full.view(2 * cp, s_local // 2, batch, local_groups, width)
    outgoing = torch.stack([chunks[k] for k in _rank_major_chunks(cp)])  # block j: rank j's tokens
    received = all_to_all(outgoing.reshape(s, batch, local_groups, width), [s_local] * cp, [s_local] * cp, group)
    # [cp (source: its groups), s/cp, b, G/cp, W] -> [s/cp, b, G, W], groups in rank order
    return received.view(cp, s_local, batch, local_groups, width).movedim(0, 2).reshape(s_local, batch, -1, width)
