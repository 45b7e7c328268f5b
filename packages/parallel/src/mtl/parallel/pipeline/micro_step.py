"""One micro-batch's forward and backward on one model chunk, shared by every schedule.

    forward_step(data_iterator, model_chunk) -> (output_tensor, loss_func)
    loss_func(output_tensor) -> (loss_scalar, metrics_dict)        # last stage only

On the last (virtual) stage the forward returns the loss divided by the number of
micro-batches, so that summing the gradients of all micro-batches gives the gradient of the
mean loss (gradient accumulation, as Megatron does). Elsewhere it returns the activation
``[s, b, h]`` that goes to the next stage.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from mtl.core.errors import ParallelError

ForwardStep = Callable[[Any, nn.Module], tuple[torch.Tensor, Callable]]
NoSyncFunc = Callable[[], ContextManager]


def forward_micro_batch(
    forward_step: ForwardStep,
    data_iterator,
    model_chunk: nn.Module,
    input_tensor: torch.Tensor | None,
    *,
    is_first_stage: bool,
    is_last_stage: bool,
    num_micro_batches: int,
    losses: list[dict],
) -> torch.Tensor:
    """Run one forward; append the loss_func's metrics to ``losses`` on the last stage."""
    if not is_first_stage:
        if not hasattr(model_chunk, "set_input_tensor"):
            raise ParallelError(
                f"model chunk {type(model_chunk).__name__} has no set_input_tensor(tensor); every "
                "chunk that is not the first pipeline stage must take its input that way"
            )
        model_chunk.set_input_tensor(input_tensor)
    output, loss_func = forward_step(data_iterator, model_chunk)
    if not is_last_stage:
        return output
    loss, metrics = loss_func(output)
    if loss.numel() != 1:
        raise ParallelError(
            f"loss_func returned a loss of shape {tuple(loss.shape)}; it must return a scalar "
            "(reduce the per-token loss, e.g. sum(loss * mask) / mask.sum())"
        )
    losses.append(metrics)
    return loss / num_micro_batches


def backward_micro_batch(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_grad: torch.Tensor | None,
) -> torch.Tensor | None:
    """Backward through one micro-batch; returns the gradient of its input (None on stage 0).

    ``output_grad`` is None on the last stage, where ``output_tensor`` is the scaled loss."""
    if output_grad is None:
        torch.autograd.backward(output_tensor)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
    if input_tensor is None:
        return None
    return input_tensor.grad


class GradSyncGate:
    """Holds the data-parallel wrapper's ``no_sync()`` open until the last backward.

    ``no_sync_func`` is one context factory for the whole rank, or a list with one per model
    chunk. A chunk's context is closed just before that chunk's last backward, so the wrapper
    reduces gradients only once, after every micro-batch has accumulated into them."""

    def __init__(self, no_sync_func: NoSyncFunc | Sequence[NoSyncFunc] | None, num_chunks: int):
        if no_sync_func is None:
            factories: list[NoSyncFunc | None] = [None] * num_chunks
            self._per_chunk = True
        elif callable(no_sync_func):
            factories = [no_sync_func]
            self._per_chunk = False
        else:
            factories = list(no_sync_func)
            if len(factories) != num_chunks:
                raise ParallelError(
                    f"no_sync_func is a list of {len(factories)} context factories but there are "
                    f"{num_chunks} model chunks; pass one per chunk or a single callable"
                )
            self._per_chunk = True
        self._stacks = []
        for factory in factories:
            stack = contextlib.ExitStack()
            if factory is not None:
                stack.enter_context(factory())
            self._stacks.append(stack)

    def before_last_backward(self, chunk: int, is_last_of_rank: bool) -> None:
        """Call before the chunk's last backward; ``is_last_of_rank`` marks the rank's very last."""
        if self._per_chunk:
            self._stacks[chunk].close()
        elif is_last_of_rank:
            self._stacks[0].close()

    def close(self) -> None:
        """Leave every context still open (forward-only runs, or an exception)."""
        for stack in self._stacks:
            stack.close()
