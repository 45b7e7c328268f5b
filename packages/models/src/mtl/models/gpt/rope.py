"""Rotary position embeddings in the rotate-half convention (as Hugging Face Llama).

The head dimension is split into two halves ``x = [x1, x2]``; position ``p`` rotates the pair
``(x1[i], x2[i])`` by the angle ``p * theta^(-2i/d)``. Meta's original Llama interleaves the
pairs instead; HF checkpoints are already permuted to this convention, so no conversion step
is needed for them.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for given positions; no parameters (the inverse frequencies are a buffer)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # [d/2]; kept fp32 whatever the model dtype: angles of large positions need it.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each fp32 [b, s, 1, d] (broadcast over heads)."""
        angles = position_ids.to(torch.float32)[..., None] * self.inv_freq  # [b, s, d/2]
        angles = torch.cat((angles, angles), dim=-1)  # [b, s, d]
        return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, d] rotated by (cos, sin) [b, s, 1, d] in x's dtype.

    The tables are computed in fp32 and rounded once to x's dtype, as Hugging Face and
    Megatron do; rotating bf16 activations in fp32 instead would add two full-size casts
    per tensor per layer and give numbers neither of them produce."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
