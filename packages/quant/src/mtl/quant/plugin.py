"""Registers the ``fp8`` backend through the ``mtl_backends`` hook (entry point ``fp8_backend``)."""

from __future__ import annotations

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import Backend
from mtl.parallel.backend_local import factories as local
from mtl.quant import factories
from mtl.quant.layers import RECIPES

FP8_BACKEND = Backend(
    name="fp8",
    column_linear=factories.column_linear,
    row_linear=factories.row_linear,
    norm=local.norm,
    core_attention=local.core_attention,
    fp8_recipes=RECIPES,
    description="FP8 GEMMs on torch._scaled_mm (current, delayed, row-wise scaling); local norms and attention",
)


@hookimpl
def mtl_backends() -> list[Backend]:
    return [FP8_BACKEND]
