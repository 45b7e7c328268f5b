"""``forward_backward``: one training (or evaluation) step over all micro-batches, choosing the
schedule from the topology: no pipelining (pp = 1), 1F1B (one chunk per rank), or
interleaved 1F1B (``vpp`` chunks per rank)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from mtl.core.errors import ParallelError

from . import p2p
from .micro_step import ForwardStep
from .schedule_1f1b import forward_backward_1f1b
from .schedule_interleaved import forward_backward_interleaved
from .schedule_no_pipeline import forward_backward_no_pipelining


def forward_backward(
    forward_step: ForwardStep,
    data_iterator,
    model_chunks: list[nn.Module],
    num_micro_batches: int,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    topology,
    forward_only: bool = False,
    no_sync_func: Callable[[], ContextManager] | Sequence[Callable[[], ContextManager]] | None = None,
) -> list[dict]:
    """Forward (and unless ``forward_only``, backward) ``num_micro_batches`` micro-batches.

    ``forward_step(data_iterator, model_chunk) -> (output_tensor, loss_func)``; on the last
    stage ``loss_func(output_tensor) -> (loss_scalar, metrics_dict)`` and the loss is divided by
    ``num_micro_batches`` before backward. ``data_iterator`` is one iterator, or (interleaved)
    a list with one per model chunk. ``tensor_shape`` is the ``[s, b, h]`` shape passed between
    stages and ``dtype`` its type. Gradients accumulate in ``.grad``; with ``no_sync_func`` (a
    data-parallel wrapper's ``no_sync``, or one per chunk) every backward except each chunk's
    last runs inside it. Returns the metrics dicts of the micro-batches on the last pipeline
    stage, in order, and [] on other stages."""
    model_chunks = list(model_chunks)
    if not model_chunks:
        raise ParallelError("forward_backward got no model chunks; pass [model] (or vpp chunks)")
    if num_micro_batches < 1:
        raise ParallelError(f"num_micro_batches = {num_micro_batches} must be at least 1")
    if len(model_chunks) != topology.vpp:
        raise ParallelError(
            f"got {len(model_chunks)} model chunks but the topology has vpp = {topology.vpp}; "
            "build one chunk per virtual pipeline stage of this rank"
        )
    data_iterators = _one_iterator_per_chunk(data_iterator, len(model_chunks))
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_mode:
        if topology.pp == 1:
            if len(model_chunks) > 1:
                raise ParallelError(
                    f"vpp = {len(model_chunks)} needs pp > 1; with one pipeline stage use vpp = 1"
                )
            return forward_backward_no_pipelining(
                forward_step,
                data_iterators[0],
                model_chunks[0],
                num_micro_batches,
                forward_only=forward_only,
                no_sync_func=no_sync_func,
            )
        p2p.ensure_pp_group_ready(topology)
        device = _device_of(model_chunks[0])
        if len(model_chunks) == 1:
            return forward_backward_1f1b(
                forward_step,
                data_iterators[0],
                model_chunks[0],
                num_micro_batches,
                tensor_shape,
                dtype,
                topology,
                device,
                forward_only=forward_only,
                no_sync_func=no_sync_func,
            )
        return forward_backward_interleaved(
            forward_step,
            data_iterators,
            model_chunks,
            num_micro_batches,
            tensor_shape,
            dtype,
            topology,
            device,
            forward_only=forward_only,
            no_sync_func=no_sync_func,
        )


def _one_iterator_per_chunk(data_iterator, num_chunks: int) -> list:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ParallelError(
                f"data_iterator is a list of {len(data_iterator)} but there are {num_chunks} model "
                "chunks; pass one iterator per chunk (or a single iterator shared by all)"
            )
        return list(data_iterator)
    return [data_iterator] * num_chunks


def _device_of(model_chunk: nn.Module) -> torch.device:
    """Where received activations are allocated: the device of the chunk's parameters."""
    for param in model_chunk.parameters():
        return param.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
