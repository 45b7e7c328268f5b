"""No pipelining (pp = 1): forward and backward each micro-batch in turn, accumulating grads."""

from __future__ import annotations

from torch import nn

from .micro_step import GradSyncGate, backward_micro_batch, forward_micro_batch


def forward_backward_no_pipelining(
    forward_step,
    data_iterator,
    model_chunk: nn.Module,
    num_micro_batches: int,
    *,
    forward_only: bool = False,
    no_sync_func=None,
) -> list[dict]:
    """Gradient accumulation over ``num_micro_batches``; returns each micro-batch's metrics.

    Gradients are reduced by the data-parallel wrapper only in the last backward: every
    earlier one runs inside ``no_sync_func()``."""
    losses: list[dict] = []
    gate = GradSyncGate(None if forward_only else no_sync_func, num_chunks=1)
    try:
        for micro_batch in range(num_micro_batches):
            loss = forward_micro_batch(
                forward_step,
                data_iterator,
                model_chunk,
                None,
                is_first_stage=True,
                is_last_stage=True,
                num_micro_batches=num_micro_batches,
                losses=losses,
            )
            if forward_only:
                continue
            if micro_batch == num_micro_batches - 1:
                gate.before_last_backward(0, is_last_of_rank=True)
            backward_micro_batch(None, loss, None)
    finally:
        gate.close()
    return losses
