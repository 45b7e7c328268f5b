"""``POST /v1/completions`` and ``POST /v1/chat/completions``: a request body to prompts,
prompts to engine requests, their outputs to one answer or a stream."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mtl.serve.chat import NoChatTemplate
from mtl.serve.engine import RequestError
from mtl.serve.protocol import ChatRequest, CompletionRequest
from mtl.serve.request_outputs import EventStream, gather_whole, stream_events, submit_all
from mtl.serve.responses import ResponseWriter
from mtl.serve.server_context import ServerContext

CLIENT_CLOSED = 499  # nginx's status for a request whose client left first: counted, never sent


async def _answer(ctx: ServerContext, request: Request, prompts, req, max_tokens, logprobs, writer: ResponseWriter):
    sub = submit_all(ctx.engine_loop, prompts, req, max_tokens, logprobs)
    with_logprobs = logprobs is not None
    if req.stream:
        return EventStream(ctx.engine_loop, sub, stream_events(ctx.engine_loop, sub, req, with_logprobs, writer))
    choices = await gather_whole(ctx.engine_loop, request, sub)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(writer.whole(choices, with_logprobs, sub.prompt_tokens))


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completion's prompt(s) as token ids: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("prompt: an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ctx.check_model(req.model)
        if req.echo:
            raise RequestError("echo: not supported; the prompt is not repeated in the completion", "echo")
        prompts = _prompt_ids(req.prompt, ctx.tokenizer)
        writer = ResponseWriter("completion", ctx.model_name, ctx.tokenizer)
        return await _answer(ctx, request, prompts, req, req.max_tokens, req.logprobs, writer)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        ctx.check_model(req.model)
        if ctx.chat_template is None:
            raise NoChatTemplate(f"messages: model {ctx.model_name!r} has no chat template (its tokenizer files hold "
                                 "no 'chat_template' in tokenizer_config.json nor a chat_template.jinja); "
                                 "use /v1/completions with a prompt")
        try:
            text = ctx.chat_template.render([m.as_dict() for m in req.messages])
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from None
        writer = ResponseWriter("chat", ctx.model_name, ctx.tokenizer)
        return await _answer(ctx, request, [ctx.tokenizer.encode(text)], req, req.token_limit, req.logprob_count,
                             writer)
