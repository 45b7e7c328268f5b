"""The gated RMSNorm at the end of the Mamba-2 mixer: ``rms_norm(y * silu(z)) * weight``, the
norm taken over each group's channels (Megatron's and HF's ``norm_before_gate=False`` with
``group_size = inner / groups``). Per group, so a TP rank holding whole groups needs nothing
from the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init


class GatedRMSNorm(nn.Module):
    def __init__(self, width: int, group_size: int, eps: float):
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = tag_init(nn.Parameter(torch.ones(width)), "ones")  # width: this rank's channels

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """y, gate ``[..., width]`` -> ``[..., width]``, computed in fp32, returned in y's dtype; ``weight``
    ``[width]`` (all of the norm's, or the share of the groups given)."""
    gated = y.float() * F.silu(gate.float())
    grouped = gated.unflatten(-1, (-1, group_size))  # [..., groups, group_size]
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * weight.float()).to(y.dtype)
