"""FP8 formats, amaxes and scales.

A scale here is the dequantisation factor ``torch._scaled_mm`` takes: ``x ≈ q * scale`` with
``q = saturate(x / scale)`` in the FP8 format, so that the tensor's largest magnitude (its
amax) lands on the format's largest value. A per-tensor scale is a scalar; a row-wise scale
is one per row, taken along the GEMM's contraction dimension (``[rows, 1]``).

Whoever computes an amax over a tensor that TP (or sequence parallelism) splits reduces it
over the TP group with ``reduce_max``: then every rank quantizes with the scale one process
would have used, and tp=N gives one process's numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def formats(fp8_format: str) -> tuple[torch.dtype, torch.dtype]:
    """(forward dtype, gradient dtype): "e4m3" everywhere, or "hybrid" (e5m2 gradients: range
    over precision, as gradients need)."""
    return E4M3, (E5M2 if fp8_format == "hybrid" else E4M3)


def amax(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """fp32 max |x| of the whole tensor (a scalar), or along ``dim`` (kept, size 1)."""
    tensor = tensor.detach()
    if dim is None:
        return tensor.abs().amax().float()
    return tensor.abs().amax(dim=dim, keepdim=True).float()


def reduce_max(value: torch.Tensor, *groups) -> torch.Tensor:
    """``value`` all-reduced with MAX over each group that is not None (in place)."""
    for group in groups:
        if group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def scale_from_amax(value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The dequantisation scale that maps ``value`` to the format's max (halved ``margin``
    times); 1 where the amax is zero or not finite (nothing to scale, or nothing sane to do)."""
    scale = value * (2.0**margin) / torch.finfo(dtype).max
    usable = torch.isfinite(value) & (value > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(tensor / scale)`` in ``dtype`` (values past the format's range clamp to it)."""
    limit = torch.finfo(dtype).max
    return (tensor.float() / scale).clamp_(-limit, limit).to(dtype)
