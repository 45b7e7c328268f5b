"""Gradients of replicated parameters that see only this rank's part of the sequence.

Under sequence parallelism the activations outside attention and the MLP are ``[s/tp, b, h]``.
A norm's weight and bias, a row-parallel layer's bias under SP and the MoE shared-expert gate
are replicated over TP, but each rank's backward covers only its own tokens: their gradient is
a partial sum. As Megatron does (``finalize_model_grads``), mtl sums such gradients over TP once
per step, after the last micro-batch and the data-parallel reduce, all of them in one
all-reduce per dtype. Summing in each micro-batch's backward instead costs one small collective
per parameter, layer and micro-batch (392 per step of the reference model at tp=2: 2 norms x 24
layers x 8 micro-batches, plus the final norm), each a launch for the host and a wait for the
device, and it reduced the gradients in the weights' dtype (bf16) rather than in the fp32 of
``main_grad``.

A layer marks such a parameter when it builds it (``mark_sequence_parallel_grad``);
``DataParallel.finish_grad_sync`` sums the marked gradients of its module. Code that trains a
sequence-parallel model without ``DataParallel`` calls ``allreduce_sequence_parallel_grads``
after the last backward of each step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from mtl.parallel.flat_collectives import sum_param_grads
from mtl.parallel.param_layout import param_layout, set_param_layout


def mark_sequence_parallel_grad(param: nn.Parameter | None) -> None:
    """Flag ``param``: its gradient is this rank's share of the sequence, summed over TP at the
    end of each step. Flagging ``None`` (a layer without bias) does nothing."""
    set_param_layout(param, sequence_parallel_grad=True)


def has_sequence_parallel_grad(param: nn.Parameter) -> bool:
    return param_layout(param).sequence_parallel_grad


def allreduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_group) -> int:
    """Sum the accumulated gradients (``main_grad`` where present, else ``grad``) of the flagged
    ``params`` over ``tp_group``, one all-reduce per gradient dtype; returns how many ran. Every
    rank of the group must pass the same parameters in the same order (the same model part);
    a flagged parameter without a gradient takes part with zeros."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return 0
    return sum_param_grads([p for p in params if has_sequence_parallel_grad(p)], tp_group)
