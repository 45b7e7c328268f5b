"""One HTTP request's engine requests: submitted together, their outputs gathered into one
answer or streamed as server-sent events, and all of them aborted when the client goes away.

A streamed request notices a gone client when a chunk cannot be written (Starlette also
listens for the disconnect while it streams). A whole answer writes nothing until the end, so
a watcher task waits for the connection's ``http.disconnect`` and wakes the gathering loop,
which aborts the request's engine requests: their KV blocks go back at once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request

from mtl.serve.engine_loop import EngineLoop
from mtl.serve.responses import ChoiceState, ResponseWriter

CLIENT_GONE = object()  # put in the outputs queue when the client closed the connection


@dataclass
class Submitted:
    outputs: asyncio.Queue
    choices: dict[int, ChoiceState]  # engine request id -> its choice
    prompt_tokens: int


def submit_all(engine_loop: EngineLoop, prompts: list[list[int]], req, max_tokens, logprobs) -> Submitted:
    """Every prompt ``req.n`` times; if one is refused, those already queued are aborted."""
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
    return Submitted(outputs, choices, sum(len(p) for p in prompts) * req.n)


async def _watch_disconnect(request: Request, outputs: asyncio.Queue) -> None:
    # the body is read by now: the next message is the disconnect (or the response's end)
    while (await request.receive())["type"] != "http.disconnect":
        pass
    outputs.put_nowait(CLIENT_GONE)


async def gather_whole(engine_loop: EngineLoop, request: Request, sub: Submitted) -> list[ChoiceState] | None:
    """Every choice to its end, by index; None if the client left first (all aborted)."""
    open_ids = set(sub.choices)
    watcher = asyncio.create_task(_watch_disconnect(request, sub.outputs))
    try:
        while open_ids:
            out = await sub.outputs.get()
            if out is CLIENT_GONE:
                return None
            sub.choices[out.request_id].add(out)
            if out.finish_reason is not None:
                open_ids.discard(out.request_id)
    finally:
        watcher.cancel()
        for rid in open_ids:
            engine_loop.abort(rid)
    return sorted(sub.choices.values(), key=lambda c: c.index)


async def stream_events(engine_loop: EngineLoop, sub: Submitted, req, with_logprobs: bool, writer: ResponseWriter):
    """Server-sent events: a chunk per output, the usage chunk if asked, then ``[DONE]``."""
    open_ids, started = set(sub.choices), set()
    try:
        while open_ids:
            out = await sub.outputs.get()
            sub.choices[out.request_id].add(out)
            if out.finish_reason is not None:
                open_ids.discard(out.request_id)
            first = out.request_id not in started
            started.add(out.request_id)
            body = writer.chunk(sub.choices[out.request_id].index, out, with_logprobs, first)
            yield f"data: {json.dumps(body)}\n\n"
        if req.stream_options is not None and req.stream_options.include_usage:
            yield f"data: {json.dumps(writer.usage_chunk(list(sub.choices.values()), sub.prompt_tokens))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): nothing of it stays in the engine
        for rid in open_ids:
            engine_loop.abort(rid)
