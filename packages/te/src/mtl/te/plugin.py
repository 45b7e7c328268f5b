"""Registers the ``te`` backend through the ``mtl_backends`` hook (entry point ``te_backend``).

This module imports without Transformer Engine, so ``mtl plugins`` lists the backend and
selecting it answers with one line naming what to install (``check_available``, called by
``RunConfig.resolve``) instead of a traceback."""

from __future__ import annotations

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import Backend
from mtl.te import factories
from mtl.te.availability import require_te
from mtl.te.config_checks import check_config

TE_BACKEND = Backend(
    name="te",
    column_linear=factories.column_linear,
    row_linear=factories.row_linear,
    norm=factories.norm,
    core_attention=factories.core_attention,
    norm_column_linear=factories.norm_column_linear,
    norm_mlp=factories.norm_mlp,
    fp8_recipes=("current", "delayed", "blockwise"),
    check_available=require_te,
    check_config=check_config,
    # TE's FP8 autocast does not trace (modules.py, _fp8_call): on the H100 reference model a
    # compiled FP8 step took 1.69 s against 1.32 s eager (benchmarks/log)
    fp8_compiles=False,
    description="Transformer Engine: Linear, LayerNormLinear, LayerNormMLP, RMSNorm/LayerNorm, DotProductAttention; FP8 recipes",
)


@hookimpl
def mtl_backends() -> list[Backend]:
    return [TE_BACKEND]
