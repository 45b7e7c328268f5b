"""The ``local`` backend: plain PyTorch leaves (TP linears, fp32 norms, fused SDPA attention)."""

from mtl.parallel.backend_local.core_attention import CoreAttention
from mtl.parallel.backend_local.factories import column_linear, core_attention, norm, row_linear
from mtl.parallel.backend_local.norms import LayerNorm, RMSNorm

__all__ = ["CoreAttention", "LayerNorm", "RMSNorm", "column_linear", "core_attention", "norm", "row_linear"]
