"""Autograd-aware communication between tensor-parallel ranks (Megatron's mappings).

Each mapping is a pair of collectives that are adjoint to each other, so the backward pass
of a TP region is the transpose of its forward:

| function                          | forward                         | backward                 |
|-----------------------------------|---------------------------------|--------------------------|
| copy_to_tensor_parallel           | identity                        | all-reduce               |
| reduce_from_tensor_parallel       | all-reduce                      | identity                 |
| scatter_to_tensor_parallel        | keep my slice of the last dim   | all-gather last dim      |
| gather_from_tensor_parallel       | all-gather last dim             | keep my slice            |
| scatter_to_sequence_parallel      | keep my slice of dim 0 (seq)    | all-gather dim 0         |
| gather_from_sequence_parallel     | all-gather dim 0                | reduce-scatter dim 0     |
| reduce_scatter_to_sequence_parallel | reduce-scatter dim 0          | all-gather dim 0         |

Activations are sequence-first ``[s, b, h]``, so sequence parallelism splits dim 0.
Every function takes the TP process group (``None`` = one rank: all are identities).
"""

from __future__ import annotations

import torch

from mtl.parallel.tensor_parallel import collectives as C


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce_sum(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return C.split_along_dim(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, 0, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group = group
        ctx.grad_is_partial = grad_is_partial
        return C.all_gather_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:  # each rank holds a partial sum of the full gradient
            return C.reduce_scatter_along_dim(grad, 0, ctx.group), None, None
        return C.split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, 0, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region by summing partial outputs: all-reduce forward, identity backward."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[..., h] -> [..., h/tp], this rank's slice of the last dimension."""
    return x if group is None else _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[..., h/tp] -> [..., h], concatenating the ranks' slices of the last dimension."""
    return x if group is None else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[s, b, h] -> [s/tp, b, h], this rank's slice of the sequence."""
    return x if group is None else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """[s/tp, b, h] -> [s, b, h]. The backward reduce-scatters (the gradient that reaches a
    gathered activation is a partial sum on each TP rank, e.g. the input of a column-parallel
    linear); with ``grad_is_partial=False`` it only keeps this rank's slice."""
    return x if group is None else _GatherFromSP.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """[s, b, h] partial sums -> [s/tp, b, h] summed: the exit of a row-parallel linear under SP."""
    return x if group is None else _ReduceScatterToSP.apply(x, group)
