"""One HTTP request's engine requests: submitted together, their outputs gathered into one
answer or streamed as server-sent events, and all of them aborted when the client goes away.

A streamed request notices a gone client when a chunk cannot be written (Starlette also
listens for the disconnect while it streams). A client gone before the stream's first step
leaves the generator unstarted, so its ``finally`` would never run: ``EventStream`` aborts
what is still open once the response ends, however it ends. A whole answer writes nothing until the end, so
a watcher task waits for the connection's ``http.disconnect`` and wakes the gathering loop,
which aborts the request's engine requests: their KV blocks go back at once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from mtl.serve.engine_loop import EngineLoop
from mtl.serve.responses import ChoiceState, ResponseWriter

CLIENT_GONE = object()  # put in the outputs queue when the client closed the connection


@dataclass
class Submitted:
    outputs: asyncio.Queue
    choices: dict[int, ChoiceState]  # engine request id -> its choice
    prompt_tokens: int
    open_ids: set[int] = field(default_factory=set)  # engine requests not finished yet

    def __post_init__(self):
        self.open_ids = set(self.choices)

    def finished(self, request_id: int) -> None:
        self.open_ids.discard(request_id)

    def abort_open(self, engine_loop: EngineLoop) -> None:
        """Abort every engine request not finished (their blocks go back); once is enough."""
        for rid in self.open_ids:
            engine_loop.abort(rid)
        self.open_ids.clear()


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
    message = await request.receive()
    while message["type"] != "http.disconnect":
        message = await request.receive()
    outputs.put_nowait(CLIENT_GONE)


async def gather_whole(engine_loop: EngineLoop, request: Request, sub: Submitted) -> list[ChoiceState] | None:
    """Every choice to its end, by index; None if the client left first (all aborted)."""
    watcher = asyncio.create_task(_watch_disconnect(request, sub.outputs))
    try:
        while sub.open_ids:
            out = await sub.outputs.get()
            if out is CLIENT_GONE:
                return None
            sub.choices[out.request_id].add(out)
            if out.finish_reason is not None:
                sub.finished(out.request_id)
    finally:
        watcher.cancel()
        sub.abort_open(engine_loop)
    return sorted(sub.choices.values(), key=lambda c: c.index)


async def stream_events(engine_loop: EngineLoop, sub: Submitted, req, with_logprobs: bool, writer: ResponseWriter):
    """Server-sent events: a chunk per output, the usage chunk if asked, then ``[DONE]``."""
    started = set()
    try:
        while sub.open_ids:
            out = await sub.outputs.get()
            sub.choices[out.request_id].add(out)
            if out.finish_reason is not None:
                sub.finished(out.request_id)
            first = out.request_id not in started
            started.add(out.request_id)
            body = writer.chunk(sub.choices[out.request_id].index, out, with_logprobs, first)
            yield f"data: {json.dumps(body)}\n\n"
        if req.stream_options is not None and req.stream_options.include_usage:
            yield f"data: {json.dumps(writer.usage_chunk(list(sub.choices.values()), sub.prompt_tokens))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): nothing of it stays in the engine
        sub.abort_open(engine_loop)


class EventStream(StreamingResponse):
    """The stream of ``stream_events``, whose engine requests are aborted when the response
    ends however it ends: also when the client left before the generator took its first step
    (Starlette then never runs it, nor its ``finally``)."""

    def __init__(self, engine_loop: EngineLoop, sub: Submitted, events):
        super().__init__(events, media_type="text/event-stream")
        self._engine_loop, self._sub = engine_loop, sub

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._sub.abort_open(self._engine_loop)
