"""Raw collectives over one process group, without autograd; the mappings build on them.

Each takes ``group=None`` to mean "one rank" and then returns its input unchanged, so that
layers run the same code at tp=1 without a process group. Concatenation along a dimension
other than 0 goes through dimension 0 (the layout NCCL's all-gather/reduce-scatter use).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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

    Here and in ``reduce_scatter_along_dim``: torch's functional collectives, and no permute where
    ``dim`` is 0 already, so that a compiled layer holds each sequence-parallel matmul next to its
    collective, the patterns async TP fuses (test_async_tp.py). The mappings return the result, so
    it is a view (function_output.py: not the tensor a collective filled or ``wait_tensor`` passed
    through; an identity ``movedim`` was that view until 2026-11-26, and hid the row linears'
    reduce-scatters from async TP)."""
    size = group_size(group)
    if size == 1:
        return x
    gathered = _functional.all_gather_into_tensor(_to_front(x, dim).contiguous(), size, group.group_name)
    return _from_front(_functional.wait_tensor(gathered), dim)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``dim``: [.., n, ..] -> [.., n/size, ..]."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the group size {size}")
    moved = _to_front(x, dim).contiguous()
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: sum everything, keep our chunk (same result, more traffic)
        summed = _functional.wait_tensor(_functional.all_reduce(moved, "sum", group.group_name))
        out = summed.chunk(size, dim=0)[group_rank(group)].contiguous()
    else:
        out = _functional.wait_tensor(_functional.reduce_scatter_tensor(moved, "sum", size, group.group_name))
    return _from_front(out, dim)


def _to_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def _from_front(x: torch.Tensor, dim: int) -> torch.Tensor:
    # at dim 0 a view all the same: wait_tensor returns the collective's result as it is, and a
    # Function must not return that (function_output.py; a view is no permute, async TP sees past it)
    return fresh_output(x) if dim == 0 else x.movedim(0, dim)


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
