"""Rotary position embeddings in the rotate-half convention (as Hugging Face Llama).

The head dimension is split into two halves ``x = [x1, x2]``; position ``p`` rotates the pair
``(x1[i], x2[i])`` by the angle ``p * theta^(-2i/d)``. Meta's original Llama interleaves the
pairs instead; HF checkpoints are already permuted to this convention, so no conversion step
is needed for them.

``model.rope_scaling = "llama3"`` rescales the frequencies as Llama 3.1 does to stretch a
model trained at ``rope_original_max_position_embeddings`` tokens: wavelengths longer than
``original / rope_low_freq_factor`` are slowed down by ``rope_scaling_factor``, those shorter
than ``original / rope_high_freq_factor`` are kept, and the band between blends the two
linearly in ``original / wavelength``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtl.core.errors import ConfigError


def rope_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """[d/2] fp32: theta^(-2i/d), the angle per position of each rotated pair."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_positions: int
) -> torch.Tensor:
    """Llama 3's frequency scaling of ``inv_freq`` [d/2] (see the module docstring)."""
    if not high_freq_factor > low_freq_factor:
        raise ConfigError(
            f"model.rope_high_freq_factor ({high_freq_factor}) must be larger than "
            f"model.rope_low_freq_factor ({low_freq_factor})"
        )
    wavelength = 2 * math.pi / inv_freq  # [d/2], in positions
    long_wave = original_max_positions / low_freq_factor  # slower than this: fully scaled
    short_wave = original_max_positions / high_freq_factor  # faster than this: kept
    scaled = torch.where(wavelength > long_wave, inv_freq / factor, inv_freq)
    # 0 at the long edge of the band, 1 at its short edge
    blend = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for given positions; no parameters (the inverse frequencies are a buffer)."""

    def __init__(self, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None):
        super().__init__()
        # [d/2]; kept fp32 whatever the model dtype: angles of large positions need it.
        if inv_freq is None:
            inv_freq = rope_inverse_frequencies(head_dim, theta)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    @classmethod
    def from_config(cls, m) -> "RotaryEmbedding":
        """The rotary embedding of a resolved ``config.model`` (plain or ``rope_scaling`` scaled)."""
        inv_freq = rope_inverse_frequencies(m.head_dim, m.rope_theta)
        scaling = getattr(m, "rope_scaling", "none")
        if scaling == "llama3":
            inv_freq = llama3_scaled(
                inv_freq,
                m.rope_scaling_factor,
                m.rope_low_freq_factor,
                m.rope_high_freq_factor,
                m.rope_original_max_position_embeddings,
            )
        elif scaling != "none":
            raise ConfigError(f"model.rope_scaling = {scaling!r} is not implemented; use 'none' or 'llama3'")
        return cls(m.head_dim, m.rope_theta, inv_freq)

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
