"""The sequence-parallel column linear as one autograd function: all-gather the sequence, then
the GEMM; in the backward, the input gradient's reduce-scatter runs beside the weight-gradient
GEMM (Megatron's linear with asynchronous gradient communication).

As two functions (``gather_from_sequence_parallel``, then the linear) the backward computes
the input gradient and the weight gradient, and only then reduce-scatters the input gradient:
nothing runs beside the transfer. Here the backward computes the input gradient, starts its
reduce-scatter, computes the weight gradient (into ``main_grad`` where the gradient-accumulation
fusion is on), and waits last. Eagerly on NCCL the transfer then runs beside that GEMM; in a
compiled layer inductor's peak-memory ordering moves the start next to the wait. The numbers are
the two functions'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtl.parallel.tensor_parallel.collectives import StartedCollectives
from mtl.parallel.tensor_parallel.wgrad_fusion import accumulate_weight_grad, fused_main_grad


class _GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, comm: StartedCollectives):
        # [s/tp, b, in] -> [s, b, in]; kept for the weight gradient
        full = comm.finish_gather(comm.start_gather(x))
        ctx.save_for_backward(full, weight)
        # not saved_tensors: main_grad is a view of a buffer other weights' gradients write to
        # before this backward, which autograd's version check would refuse (wgrad_fusion)
        ctx.main_grad, ctx.comm, ctx.has_bias = main_grad, comm, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        full, weight = ctx.saved_tensors
        comm = ctx.comm
        # every rank's input gradient is a partial sum over its output features: summed over
        # TP and split back along the sequence, while the weight gradient is computed
        pending = comm.start_reduce_scatter(grad_output @ weight)
        if ctx.main_grad is not None:
            accumulate_weight_grad(ctx.main_grad, grad_output, full)
            grad_weight = torch.empty_like(weight)  # dropped by the hook that follows (wgrad_fusion)
        else:
            grad_weight = (grad_output.reshape(-1, grad_output.shape[-1]).t()
                           @ full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return comm.finish_reduce_scatter(pending), grad_weight, grad_bias, None, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    comm: StartedCollectives) -> torch.Tensor:
    """``F.linear(all_gather(x along dim 0), weight, bias)`` over the TP group of ``comm``, with
    the backward described in the module docstring; ``x`` is ``[s/tp, b, in]``."""
    return _GatheredLinear.apply(x, weight, bias, fused_main_grad(weight), comm)
