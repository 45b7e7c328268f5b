"""LayerNorm and RMSNorm that compute in fp32 and return the input's dtype.

Under sequence parallelism the norm sees ``[s/tp, b, h]`` with a weight replicated over TP;
pass the topology and ``sequence_parallel=True`` and the weight (and bias) are marked so that
their gradients, partial on each rank, are summed over the TP group once per step
(``mtl.parallel.sequence_parallel_grads``). The weight (gain) starts at one and the bias at
zero (``init_kind``, read by initialisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.parallel.sequence_parallel_grads import mark_sequence_parallel_grad


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, topology, sequence_parallel: bool, with_bias: bool):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = tag_init(nn.Parameter(torch.ones(hidden_size)), "ones")
        self.bias = tag_init(nn.Parameter(torch.zeros(hidden_size)), "zeros") if with_bias else None
        self.sequence_parallel = sequence_parallel and topology is not None and topology.tp > 1
        if self.sequence_parallel:
            mark_sequence_parallel_grad(self.weight)
            mark_sequence_parallel_grad(self.bias)

    def _params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 views of weight and bias."""
        return self.weight.float(), (self.bias.float() if self.bias is not None else None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, topology=None, sequence_parallel: bool = False):
        super().__init__(hidden_size, eps, topology, sequence_parallel, with_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._params()
        return F.layer_norm(x.float(), (self.hidden_size,), weight, bias, self.eps).to(x.dtype)


class RMSNorm(_Norm):
    """x / sqrt(mean(x²) + eps) * weight over the last dimension (no bias, no centering)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, topology=None, sequence_parallel: bool = False):
        super().__init__(hidden_size, eps, topology, sequence_parallel, with_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self._params()
        # F.rms_norm is one fused kernel on CUDA (several elementwise passes otherwise)
        return F.rms_norm(x.float(), (self.hidden_size,), weight, self.eps).to(x.dtype)
