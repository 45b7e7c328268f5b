"""The depthwise causal convolution over x, B and C, over a whole sequence or continuing from the
last ``kernel - 1`` inputs of the ones before (decoding keeps them as its conv state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, previous: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs [b, c, s]``, ``weight [c, 1, k]``, ``previous [b, c, k - 1]`` (None: zeros, the
    sequence's start) -> ``(silu(conv) [b, c, s], the last k - 1 inputs [b, c, k - 1])``."""
    kernel = weight.shape[-1]
    if previous is None:
        padded = F.pad(inputs, (kernel - 1, 0))
    else:
        padded = torch.cat([previous.to(inputs.dtype), inputs], dim=-1)
    out = F.conv1d(padded, weight, bias, groups=inputs.shape[1])  # [b, c, s]
    return F.silu(out), padded[..., padded.shape[-1] - (kernel - 1):]
