"""The router's auxiliary losses in the backward pass, counted once however the model is split.

An MoE layer does not add its aux losses to the value the model returns (the per-token LM
loss stays clean, and a pipeline stage without the head could not add them anyway). Instead
``attach_aux_loss(output, aux)`` returns ``output`` unchanged and, in backward, gives ``aux``
the gradient ``scale``: exactly what ``(lm_loss + aux) * scale`` would give it (Megatron's
MoEAuxLossAutoScaler). Each layer's gradient enters at its own output, on the stage that holds
it. Under TP every rank computes the same aux from the same (gathered) tokens and the router's
gradients are complete on each, so nothing is summed over TP.

``scale`` is what the trainer multiplies each micro-batch's mean LM loss by before backward:
``1 / num_micro_batches`` (the schedule's division; data parallelism then averages), times the
fp16 loss scale where there is one (``set_aux_loss_scale``).
"""

from __future__ import annotations

import torch
from torch import nn


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``output`` unchanged; backward also sends ``scale`` as the gradient of ``aux_loss``."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return output  # evaluation, inference, or no coefficient: nothing to train
    return _AttachAuxLoss.apply(output, aux_loss, scale)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set the backward scale of every MoE layer in ``model`` (e.g. ``loss_scale /
    num_micro_batches`` under fp16 loss scaling; the default is ``1 / num_micro_batches``)."""
    for module in model.modules():
        # only on a change: a compiled layer guards on the value (a new one recompiles it)
        if hasattr(module, "aux_loss_scale") and module.aux_loss_scale != scale:
            module.aux_loss_scale = scale
