"""The OpenAI-compatible HTTP API (FastAPI) in front of the engine loop.

``/v1/completions``, ``/v1/chat/completions`` (whole or streamed as server-sent events),
``/v1/models``, ``/health`` and ``/metrics``. With an API key, every ``/v1`` request without
``Authorization: Bearer KEY`` answers 401 (``/health`` and ``/metrics`` stay open for probes
and scrapers, as in vLLM). Errors use OpenAI's body, ``{"error": {"message", "type", "param"}}``:
400 naming the field for a malformed request, an unknown model or a prompt the context cannot
hold; 429 when the queue is full. A streamed request whose client goes away is aborted, which
frees its KV blocks."""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mtl.serve.chat import ChatTemplate, NoChatTemplate
from mtl.serve.engine import QueueFull, RequestError
from mtl.serve.engine_loop import EngineLoop, EngineStopped
from mtl.serve.protocol import ChatRequest, CompletionRequest
from mtl.serve.responses import ChoiceState, ResponseWriter


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class _Guard:
    """ASGI middleware: the bearer-token check on /v1 and the request counter by status."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        if self.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            await error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 kind="authentication_error")(scope, receive, counting_send)
        else:
            await self.app(scope, receive, counting_send)
        self.metrics.requests.labels(path, str(status.get("code", 0))).inc()

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())


def _validation_error(_request, exc: RequestValidationError):
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        return error_response(400, f"body: not valid JSON ({first['msg']})", "body")
    return error_response(400, f"{param}: {first['msg']}", param)


def create_app(engine_loop: EngineLoop, *, model_name: str, api_key: str | None,
               chat_template: ChatTemplate | None) -> FastAPI:
    engine = engine_loop.engine
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(_app):
        engine_loop.start()
        yield
        engine_loop.stop()  # after uvicorn's graceful wait: what is still running is aborted

    app = FastAPI(title="mtl serve", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RequestError, lambda _r, exc: error_response(400, str(exc), exc.param))
    app.add_exception_handler(QueueFull, lambda _r, exc: error_response(429, str(exc), None, "rate_limit_error"))
    app.add_exception_handler(EngineStopped, lambda _r, exc: error_response(503, str(exc), None, "server_error"))
    app.add_exception_handler(NoChatTemplate, lambda _r, exc: error_response(400, str(exc), "messages"))
    app.add_middleware(_Guard, api_key=api_key, metrics=engine_loop.metrics)

    def check_model(name: str) -> None:
        if name != model_name:
            raise RequestError(f"model: {name!r} is not served here; this server serves {model_name!r}", "model")

    async def run(prompts: list[list[int]], req, max_tokens, logprobs, writer: ResponseWriter):
        outputs: asyncio.Queue = asyncio.Queue()
        choices: dict[int, ChoiceState] = {}
        try:
            for p, prompt_ids in enumerate(prompts):
                for copy in range(req.n):
                    rid = engine_loop.submit(prompt_ids, req.sampling(max_tokens, logprobs, copy), outputs)
                    choices[rid] = ChoiceState(p * req.n + copy, prompt_tokens=len(prompt_ids))
        except Exception:
            for rid in choices:
                engine_loop.abort(rid)
            raise
        prompt_tokens = sum(len(p) for p in prompts) * req.n
        if req.stream:
            return StreamingResponse(_stream(outputs, choices, req, logprobs, writer, prompt_tokens),
                                     media_type="text/event-stream")
        try:
            open_ids = set(choices)
            while open_ids:
                out = await outputs.get()
                choices[out.request_id].add(out)
                if out.finish_reason is not None:
                    open_ids.discard(out.request_id)
        finally:
            for rid in open_ids:
                engine_loop.abort(rid)
        ordered = sorted(choices.values(), key=lambda c: c.index)
        return JSONResponse(writer.whole(ordered, logprobs is not None, prompt_tokens))

    async def _stream(outputs, choices, req, logprobs, writer: ResponseWriter, prompt_tokens: int):
        open_ids, started = set(choices), set()
        try:
            while open_ids:
                out = await outputs.get()
                choices[out.request_id].add(out)
                if out.finish_reason is not None:
                    open_ids.discard(out.request_id)
                first = out.request_id not in started
                started.add(out.request_id)
                body = writer.chunk(choices[out.request_id].index, out, logprobs is not None, first)
                yield f"data: {json.dumps(body)}\n\n"
            if req.stream_options is not None and req.stream_options.include_usage:
                yield f"data: {json.dumps(writer.usage_chunk(list(choices.values()), prompt_tokens))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): nothing of it stays in the engine
            for rid in open_ids:
                engine_loop.abort(rid)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        if req.echo:
            raise RequestError("echo: not supported; the prompt is not repeated in the completion", "echo")
        prompts = _prompt_ids(req.prompt, tokenizer)
        writer = ResponseWriter("completion", model_name, tokenizer)
        return await run(prompts, req, req.max_tokens, req.logprobs, writer)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        check_model(req.model)
        if chat_template is None:
            raise NoChatTemplate(f"messages: model {model_name!r} has no chat template (its tokenizer files hold no "
                                 "'chat_template' in tokenizer_config.json nor a chat_template.jinja); "
                                 "use /v1/completions with a prompt")
        try:
            text = chat_template.render([m.as_dict() for m in req.messages])
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from None
        prompt_ids = tokenizer.encode(text)
        return await run([prompt_ids], req, req.token_limit, req.logprob_count,
                         ResponseWriter("chat", model_name, tokenizer))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mtl",
                                            "max_model_len": engine.context_length}]}

    @app.get("/health")
    async def health():
        if not engine_loop.running:
            return error_response(503, "the engine is not running", None, "server_error")
        if not engine_loop.ready.is_set():
            return error_response(503, "the engine is compiling its decode step; requests wait until it is done",
                                  None, "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine_loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completion's prompt(s) as token ids: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("prompt: an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
