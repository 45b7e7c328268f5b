"""The FP8 GEMMs of one linear layer: ``y = x Wᵀ`` forward, ``dx = dy W`` and ``dW = dyᵀ x``
backward, each as one ``scaled_mm`` of two quantized operands.

Per-tensor recipes ("current", "delayed"): the layer hands in the scales of x and W; the
forward keeps the quantized x and W for backward (an FP8 activation is half a bf16 one), and
their transposes serve the backward GEMMs under the same scale. The gradient's scale comes
from ``grad_scale(dy)``, the layer's (it reduces the amax over TP, or reads the history).

Row-wise ("rowwise"): every operand is quantized along its own GEMM's contraction dimension,
one scale per row, from the high-precision tensor; x and W are kept in their own precision
for the backward, which re-quantizes them along the other axis. Where TP splits a
contraction dimension (forward K of a row-parallel layer, backward N of a column-parallel
one) the per-row amaxes are reduced over the TP group, so every rank's scales are one
process's.

The forward GEMM may use Hopper's fast FP8 accumulation (``plan.fast_accum``, as Transformer
Engine's and torchao's recipes do); the backward GEMMs always accumulate exactly.

Where the layer takes part in mtl.parallel's gradient-accumulation fusion, ``main_grad`` is
the weight's fp32 buffer and the weight-gradient GEMM adds into it (``scaled_mm_accumulate``:
cuBLASLt's epilogue on a GPU); the gradient returned to autograd is then an empty tensor that
the DataParallel hook drops, as for the local backend's fused linears.

A layer with a weight cache (``weight_cache.py``) hands in ``plan.weight``, the weight's FP8
operands for both GEMMs already built (once per optimizer step); the forward then quantizes
only x, and the backward reads the cached transpose instead of transposing W's FP8 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mtl.quant.scaled_matmul import scaled_mm, scaled_mm_accumulate
from mtl.quant.scaling import E4M3, amax, quantize, reduce_max, scale_from_amax
from mtl.quant.weight_cache import QuantizedWeight


@dataclass
class GemmPlan:
    """How one layer's three GEMMs are quantized (built by the layer, once per call)."""

    rowwise: bool
    grad_dtype: torch.dtype
    tp_group: Any  # None at tp=1
    k_split: bool  # the forward contraction (input features) is split over TP: row-parallel
    grad_scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # per-tensor: dy -> scale
    scale_x: torch.Tensor | None = None  # per-tensor: the forward scales
    scale_w: torch.Tensor | None = None
    weight: QuantizedWeight | None = None  # the cached FP8 weight (None: quantized here, per call)
    fast_accum: bool = False  # the forward GEMM in Hopper's fast accumulation (train.fp8_fast_accumulation)
    cp_group: Any = None  # context parallelism splits the tokens over it (None at cp=1)


def _rowwise(t: torch.Tensor, dtype: torch.dtype, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [rows, K] quantized with one scale per row (amax over K, reduced over ``group``)."""
    scale = scale_from_amax(reduce_max(amax(t, dim=1), group), dtype)
    return quantize(t, scale, dtype), scale


def _k_group(plan: GemmPlan):
    """The group the forward contraction (K) is split over: TP for a row-parallel layer."""
    return plan.tp_group if plan.k_split else None


def _n_group(plan: GemmPlan):
    """The group the input-gradient contraction (N) is split over: TP for a column-parallel layer."""
    return None if plan.k_split else plan.tp_group


def quantize_weight(weight: torch.Tensor, plan: GemmPlan, scale_w: torch.Tensor | None) -> QuantizedWeight:
    """Both FP8 operands of W exactly as the uncached GEMMs below build them (the weight
    cache's refresh): per tensor with ``scale_w``, or row-wise along each GEMM's contraction."""
    if plan.rowwise:
        return QuantizedWeight(_rowwise(weight, E4M3, _k_group(plan)), _rowwise(weight.t(), E4M3, _n_group(plan)))
    wq = quantize(weight, scale_w, E4M3)
    return QuantizedWeight((wq, scale_w), (wq.t().contiguous(), scale_w))


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan, out_dtype: torch.dtype,
                main_grad: torch.Tensor | None = None):
        """x [M, K], weight [N, K] -> [M, N] in out_dtype; dW into ``main_grad`` where given."""
        ctx.plan, ctx.x_dtype, ctx.weight_dtype = plan, x.dtype, weight.dtype
        # an argument, so torch.compile sees the buffer the backward mutates as an input; not
        # saved_tensors: other weights' gradients write to the same flat buffer before this
        # backward, which autograd's version check would refuse (as wgrad_fusion's linear)
        ctx.main_grad = main_grad
        cached = plan.weight
        if plan.rowwise:
            xq, sx = _rowwise(x, E4M3, _k_group(plan))
            wq, sw = cached.forward if cached is not None else _rowwise(weight, E4M3, _k_group(plan))
            ctx.save_for_backward(x, weight)
        else:
            xq, sx = quantize(x, plan.scale_x, E4M3), plan.scale_x
            wq, sw = cached.forward if cached is not None else (quantize(weight, plan.scale_w, E4M3), plan.scale_w)
            ctx.save_for_backward(xq, wq)  # a cached wq costs nothing more here: the cache holds it
        return scaled_mm(xq, sx, wq, sw, out_dtype, plan.fast_accum)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan = ctx.plan
        saved = ctx.saved_tensors  # under activation checkpointing, this is where the forward is recomputed
        dy = dy.contiguous()
        cached = plan.weight  # its backward operand: Wᵀ in FP8, built with the forward's
        if plan.rowwise:
            x, weight = saved
            # dx [M, K] = dy [M, N] @ W [N, K]: contraction over N
            dyq, s_dy = _rowwise(dy, plan.grad_dtype, _n_group(plan))
            wtq, s_wt = cached.backward if cached is not None else _rowwise(weight.t(), E4M3, _n_group(plan))
            dx = scaled_mm(dyq, s_dy, wtq, s_wt, ctx.x_dtype)
            # dW [N, K] = dyᵀ [N, M] @ x [M, K]: contraction over the tokens, whole on every TP
            # rank (sequence parallelism gathers them) but split over cp
            dytq, s_dyt = _rowwise(dy.t(), plan.grad_dtype, plan.cp_group)
            xtq, s_xt = _rowwise(x.t(), E4M3, plan.cp_group)
            return dx, _weight_grad(ctx.main_grad, dytq, s_dyt, xtq, s_xt, ctx.weight_dtype), None, None, None
        xq, wq = saved
        s_dy = plan.grad_scale(dy)
        dyq = quantize(dy, s_dy, plan.grad_dtype)
        wtq, s_wt = cached.backward if cached is not None else (wq.t().contiguous(), plan.scale_w)
        dx = scaled_mm(dyq, s_dy, wtq, s_wt, ctx.x_dtype)
        dw = _weight_grad(ctx.main_grad, dyq.t().contiguous(), s_dy, xq.t().contiguous(), plan.scale_x,
                          ctx.weight_dtype)
        return dx, dw, None, None, None


def _weight_grad(main_grad: torch.Tensor | None, dytq: torch.Tensor, s_dyt: torch.Tensor, xtq: torch.Tensor,
                 s_xt: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``dW [N, K] = dyᵀ x`` from its FP8 operands ``dyᵀ [N, M]`` and ``xᵀ [K, M]``: added into
    ``main_grad`` where given, and the gradient autograd gets is then only a placeholder that
    the DataParallel hook drops (``param.wgrad_fused``); else returned in the weight's dtype."""
    if main_grad is not None:
        scaled_mm_accumulate(main_grad, dytq, s_dyt, xtq, s_xt)
        return torch.empty(dytq.shape[0], xtq.shape[0], dtype=weight_dtype, device=dytq.device)
    return scaled_mm(dytq, s_dyt, xtq, s_xt, weight_dtype)
