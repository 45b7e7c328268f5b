"""The OpenAI-compatible HTTP API (FastAPI) in front of the engine loop.

``create_app`` puts together the routes (``generation_routes.py``: ``/v1/completions`` and
``/v1/chat/completions``, whole or streamed; ``info_routes.py``: ``/v1/models``, ``/health``,
``/metrics``), the guard (``guard.py``: API key on ``/v1``, the request counter) and the
error bodies. Errors use OpenAI's body, ``{"error": {"message", "type", "param"}}``: 400
naming the field for a malformed request, an unknown model or a prompt the context cannot
hold; 401 without the API key; 429 when the queue is full; 503 when the engine is down. A
request whose client goes away, streamed or not, is aborted, which frees its KV blocks."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from mtl.serve.chat import ChatTemplate, NoChatTemplate
from mtl.serve.engine import QueueFull, RequestError
from mtl.serve.engine_loop import EngineLoop, EngineStopped
from mtl.serve.generation_routes import add_generation_routes
from mtl.serve.guard import Guard, error_response
from mtl.serve.info_routes import add_info_routes
from mtl.serve.server_context import ServerContext


def _validation_error(_request, exc: RequestValidationError):
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        return error_response(400, f"body: not valid JSON ({first['msg']})", "body")
    return error_response(400, f"{param}: {first['msg']}", param)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RequestError, lambda _r, exc: error_response(400, str(exc), exc.param))
    app.add_exception_handler(QueueFull, lambda _r, exc: error_response(429, str(exc), None, "rate_limit_error"))
    app.add_exception_handler(EngineStopped, lambda _r, exc: error_response(503, str(exc), None, "server_error"))
    app.add_exception_handler(NoChatTemplate, lambda _r, exc: error_response(400, str(exc), "messages"))


def create_app(engine_loop: EngineLoop, *, model_name: str, api_key: str | None,
               chat_template: ChatTemplate | None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine_loop.start()
        yield
        engine_loop.stop()  # after uvicorn's graceful wait: what is still running is aborted

    app = FastAPI(title="mtl serve", lifespan=lifespan)
    _add_error_handlers(app)
    ctx = ServerContext(engine_loop, model_name, chat_template)
    add_generation_routes(app, ctx)
    add_info_routes(app, ctx)
    app.add_middleware(Guard, api_key=api_key, metrics=engine_loop.metrics, routes=app.router.routes)
    return app
