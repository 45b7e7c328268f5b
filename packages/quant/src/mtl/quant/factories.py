"""The factories of the ``fp8`` backend, with the calls of ``mtl.core.registrations.Backend``.

A linear given ``fp8=Fp8Settings`` (the transformer layers' linears when ``train.fp8`` is
set) is an FP8 layer; one without (the output layer, or ``train.fp8 = "none"``) is
mtl.parallel's plain layer in the compute precision. Norms and core attention are the local
backend's.
"""

from __future__ import annotations

from torch import nn

from mtl.core.registrations import Fp8Settings
from mtl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mtl.quant.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear


def column_linear(input_size: int, output_size: int, *, fp8: Fp8Settings | None = None, **kwargs) -> nn.Module:
    if fp8 is None:
        return ColumnParallelLinear(input_size, output_size, **kwargs)
    return Fp8ColumnParallelLinear(input_size, output_size, fp8=fp8, **kwargs)


def row_linear(input_size: int, output_size: int, *, fp8: Fp8Settings | None = None, **kwargs) -> nn.Module:
    if fp8 is None:
        return RowParallelLinear(input_size, output_size, **kwargs)
    return Fp8RowParallelLinear(input_size, output_size, fp8=fp8, **kwargs)
