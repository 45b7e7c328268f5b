"""Raw collectives over one process group, without autograd; the mappings build on them.

Each takes ``group=None`` to mean "one rank" and then returns its input unchanged, so that
layers run the same code at tp=1 without a process group. Concatenation along a dimension
other than 0 goes through dimension 0 (the layout NCCL's all-gather/reduce-scatter use).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.parallel.flat_collectives import all_gather_flat, reduce_scatter_flat
from mtl.parallel.function_output import fresh_output

_functional = torch.ops._c10d_functional


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a fresh tensor (the input is left untouched)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return fresh_output(out)  # the row-parallel linear's output at tp > 1 without sp (function_output.py)


def all_reduce_max_(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum over the group, in place on ``x`` (a tensor the caller owns)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, in place on ``x`` (a tensor the caller owns)."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def split_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (size must divide evenly)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the group size {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def all_gather_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``: [.., n, ..] -> [.., n*size, ..].

    The result is ``movedim``'s view of the tensor the collective filled, here and in
    ``reduce_scatter_along_dim``, also where ``dim`` is 0 (an identity permute): the sequence-parallel
    mappings return it, and a Function must not return the tensor it filled (function_output.py;
    without the view, 2 H200s under torch 2.11 trained tp=2 + sp on a zero gradient through each row
    linear and their compiled backward read past the gradient buffer). The identity permute also hides
    the row linears' collectives from async TP's pass."""
    size = group_size(group)
    if size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] * size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``dim``: [.., n, ..] -> [.., n/size, ..]."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the group size {size}")
    moved = x.movedim(dim, 0).contiguous()
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: sum everything, keep our chunk (same result, more traffic)
        summed = moved.clone()
        dist.all_reduce(summed, group=group)
        out = summed.chunk(size, dim=0)[group_rank(group)].contiguous()
    else:
        out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        reduce_scatter_flat(out, moved, group=group)
    return out.movedim(0, dim)


class StartedCollectives:
    """All-gather and reduce-scatter along dim 0 over ``group``, each started and waited on
    apart, so compute that does not need the result runs between (torch's functional
    collectives: asynchronous on NCCL, and traceable, so a compiled layer keeps them in its
    graph). gloo has no reduce-scatter: there it sums everything and keeps this rank's share
    (more traffic, same result)."""

    def __init__(self, group) -> None:
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.name = group.group_name
        self.sum_by_all_reduce = dist.get_backend(group) == "gloo"

    def start_gather(self, local: torch.Tensor) -> torch.Tensor:
        return _functional.all_gather_into_tensor(local.contiguous(), self.size, self.name)

    def finish_gather(self, pending: torch.Tensor) -> torch.Tensor:
        return _functional.wait_tensor(pending)

    def start_reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        if self.sum_by_all_reduce:
            return _functional.all_reduce(full.contiguous(), "sum", self.name)
        return _functional.reduce_scatter_tensor(full.contiguous(), "sum", self.size, self.name)

    def finish_reduce_scatter(self, pending: torch.Tensor) -> torch.Tensor:
        summed = _functional.wait_tensor(pending)
        return summed.chunk(self.size)[self.rank] if self.sum_by_all_reduce else summed
