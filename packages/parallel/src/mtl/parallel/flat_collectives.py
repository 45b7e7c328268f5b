"""torch.distributed's all-gather and reduce-scatter of one flat tensor, under this torch's name.

torch 2.13 renamed them (``all_gather_into_tensor`` -> ``all_gather_single``,
``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and the old names warn on every call
(a FutureWarning per rank in each run's log); torch 2.11, the GPU machines' release, has only
the old names. Both take ``(output, input, [op,] group=..., async_op=...)``, and dynamo turns
either into torch's functional collectives inside a compiled region. Also: many small tensors
summed in one all-reduce (``all_reduce_as_one``, ``sum_param_grads``).
"""

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_as_one(tensors: Sequence[torch.Tensor], group) -> None:
    """Sum each tensor over ``group`` in place with one all-reduce of their concatenation (one
    launch and one wait instead of one per tensor); all must have one dtype."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def sum_param_grads(params: Iterable[nn.Parameter], group) -> int:
    """Sum the accumulated gradients of ``params`` over ``group``: a data-parallel wrapper's
    ``main_grad`` where present, else ``.grad`` (zeros for a parameter that got none), one
    all-reduce per gradient dtype; returns how many ran. Every rank of the group must pass
    matching parameters in the same order."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        grad = getattr(param, "main_grad", None)
        if grad is None:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        all_reduce_as_one(grads, group)
    return len(by_dtype)
