"""The factories of the ``te`` backend, with the calls of ``mtl.core.registrations.Backend``.

Each imports ``mtl.te.modules`` (and so Transformer Engine) only when called: without TE,
building a layer raises the one-line ``NotInstalledError`` of ``mtl.te.availability``.
"""

from __future__ import annotations

from torch import nn

from mtl.te.availability import require_te


def _modules():
    require_te()
    from mtl.te import modules  # noqa: PLC0415 (imports transformer_engine)

    return modules


def column_linear(input_size: int, output_size: int, **kwargs) -> nn.Module:
    return _modules().TEColumnParallelLinear(input_size, output_size, **kwargs)


def row_linear(input_size: int, output_size: int, **kwargs) -> nn.Module:
    return _modules().TERowParallelLinear(input_size, output_size, **kwargs)


def norm_column_linear(input_size: int, output_size: int, **kwargs) -> nn.Module:
    return _modules().TENormColumnParallelLinear(input_size, output_size, **kwargs)


def norm_mlp(**kwargs) -> nn.Module:
    return _modules().TENormMLP(**kwargs)


def norm(hidden_size: int, *, kind: str, eps: float, topology=None, sequence_parallel: bool = False) -> nn.Module:
    return _modules().build_norm(hidden_size, kind=kind, eps=eps, topology=topology, sequence_parallel=sequence_parallel)


def core_attention(**kwargs) -> nn.Module:
    return _modules().TECoreAttention(**kwargs)
