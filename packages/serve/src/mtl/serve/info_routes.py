"""``GET /v1/models``, ``/health`` (503 while the engine is down or compiling) and
``/metrics`` (Prometheus text)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mtl.serve.guard import error_response
from mtl.serve.server_context import ServerContext


def add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    loop = ctx.engine_loop

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "mtl",
                                            "max_model_len": loop.engine.context_length}]}

    @app.get("/health")
    async def health():
        if not loop.running:
            return error_response(503, "the engine is not running", None, "server_error")
        if not loop.ready.is_set():
            return error_response(503, "the engine is compiling its decode step; requests wait until it is done",
                                  None, "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)
