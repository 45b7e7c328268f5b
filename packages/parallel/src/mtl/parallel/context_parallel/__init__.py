"""Context parallelism: the sequence is split over the cp group, and attention runs as a ring
(``topology.cp_comm_type = "p2p"``) or over all-gathered keys and values ("all_gather").

    q, k, v = (split_for_context_parallel(t, 1, topo) for t in (q, k, v))  # [b, s/cp, *, d]
    out = context_parallel_attention(q, k, v, topology=topo)                # [b, s/cp, heads, d]
    pos = context_parallel_position_ids(s, topo)                            # global positions
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtl.core.errors import ParallelError
from mtl.parallel.context_parallel.all_gather_attention import all_gather_attention
from mtl.parallel.context_parallel.flash_blocks import fused_kernel
from mtl.parallel.context_parallel.ring_attention import CpRing, RingAttention
from mtl.parallel.context_parallel.sharding import (
    context_parallel_position_ids,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from mtl.parallel.topology import Topology

__all__ = [
    "context_parallel_attention",
    "context_parallel_position_ids",
    "gather_from_context_parallel",
    "split_for_context_parallel",
]


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ParallelError(
                f"context_parallel_attention: {name} has shape {tuple(t.shape)}; expected 4 dims "
                "[batch, local_seq, heads (groups for k/v), head_dim]"
            )
    if k.shape != v.shape:
        raise ParallelError(
            f"context_parallel_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape"
        )
    b, s, heads, d = q.shape
    if (k.size(0), k.size(1), k.size(3)) != (b, s, d):
        raise ParallelError(
            f"context_parallel_attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on "
            "batch, local sequence length or head_dim"
        )
    if heads % k.size(2):
        raise ParallelError(
            f"context_parallel_attention: {heads} query heads are not a multiple of {k.size(2)} "
            "key/value groups; set model.num_query_groups to a divisor of model.num_attention_heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ParallelError(
            f"context_parallel_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ParallelError(f"context_parallel_attention: dropout_p {dropout_p} must be in [0, 1)")


def _single_rank_attention(q, k, v, causal: bool, dropout_p: float, scale: float) -> torch.Tensor:
    """cp == 1: PyTorch's fused attention on the whole sequence (dropout supported here)."""
    repeats = q.size(2) // k.size(2)
    if repeats > 1:  # grouped-query attention: query head h reads group h // repeats
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    # [b, s, heads, d] -> [b, heads, s, d] and back
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=dropout_p, is_causal=causal, scale=scale,
    )
    return out.transpose(1, 2)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topology: Topology,
    causal: bool = True,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention over the whole sequence when each cp rank holds only its share of it.

    q ``[b, s_local, heads, d]``, k/v ``[b, s_local, groups, d]`` (heads a multiple of groups),
    each laid out as ``split_for_context_parallel`` lays it out; returns ``[b, s_local, heads, d]``
    in the same layout. ``softmax_scale`` defaults to ``1/sqrt(d)``. Differentiable, with an
    exact backward that runs the ring again.

    With cp == 1 this is PyTorch's ``scaled_dot_product_attention``. Attention dropout is not
    supported with cp > 1 and raises ``ParallelError``: the ring would have to replay the
    same dropout mask per block pair in the backward."""
    _check_inputs(q, k, v, dropout_p)
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    if topology.cp == 1:
        return _single_rank_attention(q, k, v, causal, dropout_p, scale)
    if dropout_p > 0.0:
        raise ParallelError(
            "attention dropout is not supported with context parallelism; set model.attention_dropout = 0"
        )
    if causal and q.size(1) % 2:
        raise ParallelError(
            f"context_parallel_attention: local sequence length {q.size(1)} is odd; with cp = "
            f"{topology.cp} each rank holds two equal chunks, so split inputs with split_for_context_parallel"
        )
    if topology.cp_comm_type == "all_gather":
        return all_gather_attention(q, k, v, topology, causal, scale, _fused_kernel(q.device, q.dtype, q.size(-1)))
    if topology.cp_comm_type != "p2p":
        raise ParallelError(f"cp_comm_type {topology.cp_comm_type!r} is not one of p2p, all_gather")
    return _ring_attention(q, k, v, topology, causal, scale)


@torch.compiler.assume_constant_result
def _fused_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The fused kernel the pieces run on (``flash_blocks.fused_kernel``), decided outside the
    traced graph: it reads the device's generation and SDPA's switches. A compiled layer keeps
    the kernel it was traced with (the ring reads the switches on every call)."""
    return fused_kernel(device, dtype, head_dim)


@torch.compiler.disable(recursive=True)
def _ring_attention(q, k, v, topology: Topology, causal: bool, scale: float) -> torch.Tensor:
    """The ring runs eagerly even inside a compiled layer (``train.compile``): its
    point-to-point exchanges are not traceable, so the layer's graph ends before it and
    resumes after it, by design rather than by a break dynamo stumbles on."""
    return RingAttention.apply(q, k, v, CpRing(topology), causal, scale)
