"""Registers the ``local`` backend through the ``mtl_backends`` hook (entry point ``local_backend``)."""

from __future__ import annotations

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import Backend
from mtl.parallel.backend_local import factories

LOCAL_BACKEND = Backend(
    name="local",
    column_linear=factories.column_linear,
    row_linear=factories.row_linear,
    norm=factories.norm,
    core_attention=factories.core_attention,
    description="plain PyTorch: tensor-parallel linears, fp32 LayerNorm/RMSNorm, fused SDPA attention",
)


@hookimpl
def mtl_backends() -> list[Backend]:
    return [LOCAL_BACKEND]
