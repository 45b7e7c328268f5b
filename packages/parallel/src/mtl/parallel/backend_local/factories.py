"""The four factories of the ``local`` backend, with the exact calls of ``mtl.core.registrations.Backend``."""

from __future__ import annotations

from torch import nn

from mtl.core.errors import ConfigError
from mtl.parallel.backend_local.core_attention import CoreAttention
from mtl.parallel.backend_local.norms import LayerNorm, RMSNorm
from mtl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

NORM_KINDS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def column_linear(
    input_size: int,
    output_size: int,
    *,
    bias: bool,
    init_std: float,
    topology,
    gather_output: bool = False,
    sequence_parallel: bool = False,
    stride: int = 1,
    **kwargs,
) -> nn.Module:
    return ColumnParallelLinear(
        input_size,
        output_size,
        bias=bias,
        init_std=init_std,
        topology=topology,
        gather_output=gather_output,
        sequence_parallel=sequence_parallel,
        stride=stride,
        **kwargs,
    )


def row_linear(
    input_size: int,
    output_size: int,
    *,
    bias: bool,
    init_std: float,
    topology,
    input_is_parallel: bool = True,
    sequence_parallel: bool = False,
    **kwargs,
) -> nn.Module:
    return RowParallelLinear(
        input_size,
        output_size,
        bias=bias,
        init_std=init_std,
        topology=topology,
        input_is_parallel=input_is_parallel,
        sequence_parallel=sequence_parallel,
        **kwargs,
    )


def norm(hidden_size: int, *, kind: str, eps: float, topology=None, sequence_parallel: bool = False) -> nn.Module:
    """``kind`` is "layernorm" or "rmsnorm". Pass ``topology`` and ``sequence_parallel`` when
    the norm runs on ``[s/tp, b, h]`` so its gradients are summed over TP."""
    if kind not in NORM_KINDS:
        raise ConfigError(
            f"model.normalization = '{kind}' is not a norm the local backend builds; "
            f"use one of {sorted(NORM_KINDS)}"
        )
    return NORM_KINDS[kind](hidden_size, eps, topology=topology, sequence_parallel=sequence_parallel)


def core_attention(
    *,
    num_heads: int,
    num_query_groups: int,
    head_dim: int,
    causal: bool,
    dropout: float,
    topology,
    softmax_scale: float | None = None,
) -> nn.Module:
    return CoreAttention(
        num_heads=num_heads,
        num_query_groups=num_query_groups,
        head_dim=head_dim,
        causal=causal,
        dropout=dropout,
        topology=topology,
        softmax_scale=softmax_scale,
    )
