"""All-to-all with variable splits along dim 0, differentiable: the exchange that sends each
token to the expert-parallel rank holding its expert, and its results back.

    # input [n_in, h], rows grouped by destination rank: input_splits[j] rows go to rank j
    output = all_to_all(input, output_splits, input_splits, group)
    # output [n_out, h], rows grouped by source rank: output_splits[i] rows came from rank i

The backward of an exchange is the reverse exchange of the output gradient (splits swapped),
so a token's gradient travels back to the rank that sent it.

Gloo implements ``all_to_all_single`` with uneven splits (alltoallv) on CPU, NCCL on GPUs;
the list form ``all_to_all`` refuses uneven sizes on gloo, so only the single form is used.
Split sizes are host integers, as both backends need them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError
from mtl.parallel.function_output import fresh_output


def _exchange(input: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    input = input.contiguous()
    output = input.new_empty((sum(output_splits), *input.shape[1:]))
    dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return fresh_output(output)  # filled in place by the exchange


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, output_splits, input_splits, group):
        ctx.splits = (list(output_splits), list(input_splits))
        ctx.group = group
        return _exchange(input, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        # the reverse exchange: what came from rank i goes back to rank i
        return _exchange(grad_output, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(input: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Send ``input_splits[j]`` leading-dim rows of ``input`` to rank j of ``group`` (in
    order), receive ``output_splits[i]`` from rank i; differentiable. ``group`` None (one
    rank) returns ``input`` unchanged."""
    if group is None:
        return input
    if len(output_splits) != dist.get_world_size(group) or len(input_splits) != dist.get_world_size(group):
        raise ParallelError(
            f"all_to_all: {len(input_splits)} input and {len(output_splits)} output splits for a group of "
            f"{dist.get_world_size(group)} ranks; give one split per rank"
        )
    if sum(input_splits) != input.shape[0]:
        raise ParallelError(f"all_to_all: input splits {list(input_splits)} do not add up to the {input.shape[0]} input rows")
    return _AllToAll.apply(input, output_splits, input_splits, group)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """``send_counts [ep, k]`` (rows this rank sends to each of rank j's ``k`` local experts)
    -> ``recv_counts [ep, k]`` (rows rank i sends to each of this rank's local experts): the
    small all-to-all that precedes a token exchange, so each rank knows its output splits."""
    if group is None:
        return send_counts
    send_counts = send_counts.contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts
