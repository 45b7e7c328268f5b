"""A streamed request whose client is gone before the stream takes its first step: the app
is called as a server calls it (ASGI, in process), the disconnect already waiting after the
body. Starlette then never starts the event generator: with ASGI spec 2.4 the first send
raises OSError (the connection is closed); before 2.4 Starlette's disconnect listener cancels
the stream while its first send waits on the network. The request's engine requests must be
aborted anyway, not run to the end of their tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest
import torch
from starlette.requests import ClientDisconnect

from mtl.serve.engine import Engine, EngineConfig
from mtl.serve.engine_loop import EngineLoop
from mtl.serve.metrics import ServeMetrics
from mtl.serve.server import create_app


@pytest.mark.parametrize("spec_version", ["2.4", "2.3"])
def test_a_stream_whose_client_left_before_it_started_is_aborted(make_model, spec_version):
    engine = Engine(make_model(seq_length=256), EngineConfig(kv_memory="2MiB", block_size=4), torch.device("cpu"))
    hold = threading.Event()  # the engine thread waits here: the request cannot run before the client leaves
    loop = EngineLoop(engine, ServeMetrics(), warm_up=lambda: hold.wait(10))
    app = create_app(loop, model_name="tiny", api_key=None, chat_template=None)
    loop.start()
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True, "n": 2,
                       "ignore_eos": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if len(messages) > 1 else messages[0]

    async def send(message):
        if spec_version == "2.4":
            raise OSError("the connection is closed")
        await asyncio.sleep(0.05)  # a send waiting for the socket to drain
        sent.append(message["type"])

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    try:
        with contextlib.suppress(ClientDisconnect):
            asyncio.run(app(scope, receive, send))
        assert "http.response.body" not in sent  # no chunk went out: the generator never ran
        hold.set()
        prompt_tokens = 2 * len(engine.tokenizer.encode("Hello"))
        for _ in range(400):  # until the engine took both requests and has nothing left to run
            if loop.metrics.prompt_tokens._value.get() == prompt_tokens and not engine.has_work:
                break
            threading.Event().wait(0.05)
        assert not engine.has_work and engine.blocks.blocks_in_use == 0
        assert loop.metrics.generated_tokens._value.get() == 0
    finally:
        hold.set()
        loop.stop()

