"""LayerNorm and RMSNorm that compute in fp32 and return the input's dtype.

Under sequence parallelism the norm sees ``[s/tp, b, h]`` with a weight replicated over TP;
pass the topology and ``sequence_parallel=True`` and the weight (and bias) gradients are
summed over the TP group in backward, so they are complete on every rank. The weight (gain)
starts at one and the bias at zero (``init_kind``, read by initialisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.parallel.tensor_parallel.mappings import copy_to_tensor_parallel


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, topology, sequence_parallel: bool, with_bias: bool):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = tag_init(nn.Parameter(torch.ones(hidden_size)), "ones")
        self.bias = tag_init(nn.Parameter(torch.zeros(hidden_size)), "zeros") if with_bias else None
        tp_group = topology.tp_group if topology is not None else None
        self._sp_group = tp_group if sequence_parallel else None

    def _params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 views of weight and bias; under SP their gradients are summed over TP."""
        weight, bias = self.weight, self.bias
        if self._sp_group is not None:
            weight = copy_to_tensor_parallel(weight, self._sp_group)
            bias = copy_to_tensor_parallel(bias, self._sp_group) if bias is not None else None
        return weight.float(), (bias.float() if bias is not None else None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self._sp_group is not None}"


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
