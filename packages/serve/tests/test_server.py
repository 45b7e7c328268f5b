"""`mtl serve` as a process, driven by the official `openai` client: the same tokens as `mtl
generate`, the chat template, 64 concurrent streams, a client leaving mid-stream, the API key,
and bad requests answered 400 naming the field while the server keeps serving."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import openai
import pytest
import torch
from click.testing import CliRunner

from mtl.cli.main import cli
from mtl.models.generate import generate
from mtl.serve.loading import load_checkpoint

CONTEXT = 256  # the checkpoint fixture's seq_length

PROMPTS = ["hello world", "the quick brown fox", "pack my box with five dozen liquor jugs", "a", "tokens stream out"]


def mtl_generate_ids(checkpoint: str, prompt: str, max_new_tokens: int) -> tuple[str, list[int]]:
    """`mtl generate --temperature 0 --show-ids`: (the continuation's text, its token ids)."""
    result = CliRunner().invoke(cli, ["generate", checkpoint, "--prompt", prompt, "--max-new-tokens",
                                      str(max_new_tokens), "--temperature", "0", "--show-ids"])
    assert result.exit_code == 0, result.output
    text, _, new_ids = result.output.rstrip("\n").rsplit("\n", 2)
    return text[len(prompt):], [int(i) for i in new_ids.removeprefix("new ids:").split()]


def test_greedy_completions_equal_mtl_generate(checkpoint, client):
    for prompt in PROMPTS:
        text, ids = mtl_generate_ids(checkpoint["dir"], prompt, 12)
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        choice = reply.choices[0]
        assert choice.text == text
        assert reply.usage.completion_tokens == len(ids)
        assert choice.finish_reason == ("length" if len(ids) == 12 else "stop")
        # the token strings line up one to one with mtl generate's ids
        tokenizer = load_tokenizer(checkpoint)
        assert choice.logprobs.tokens == [tokenizer.decode([i]) for i in ids]


_TOKENIZER = {}


def load_tokenizer(checkpoint):
    if "t" not in _TOKENIZER:
        from mtl.core.plugins import registry
        _TOKENIZER["t"] = registry("tokenizer").get("hf").build(checkpoint["tokenizer"])
    return _TOKENIZER["t"]


def test_chat_completion_renders_the_tokenizers_template(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello world"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    rendered = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    plain = client.completions.create(model="tiny", prompt=rendered, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in chat.choices[0].logprobs.content)


def test_64_concurrent_streams_of_mixed_lengths(checkpoint, server):
    loaded = load_checkpoint(checkpoint["dir"], device=torch.device("cpu"))
    words = "the quick brown fox jumps over the lazy dog hello world pack my box".split()
    jobs = [(" ".join(words[: 1 + i % len(words)] * (1 + i % 3)), 1 + (i * 7) % 24) for i in range(64)]
    expected = []
    for prompt, max_tokens in jobs:
        ids = generate(loaded.model, loaded.tokenizer.encode(prompt), max_tokens, temperature=0,
                       eod=loaded.tokenizer.eod)
        expected.append(loaded.tokenizer.decode(ids))

    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in jobs))

    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == expected
    assert all(finish in ("length", "stop") for _, finish in results)
    server.wait_idle()


def test_a_client_leaving_mid_stream_frees_its_blocks(server, client):
    server.wait_idle()
    before = server.metric("mtl_serve_generated_tokens_total")
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=CONTEXT - 8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    server.wait_idle()
    time.sleep(0.2)  # nothing of it keeps running
    generated = server.metric("mtl_serve_generated_tokens_total") - before
    assert 1 <= generated < CONTEXT - 8, generated


def test_a_client_leaving_before_a_whole_answer_frees_its_blocks(server):
    """A non-streamed request writes nothing until its end: the server notices the closed
    connection itself, aborts the request and counts it as 499."""
    server.wait_idle()
    before = server.metric("mtl_serve_generated_tokens_total")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT - 8, "temperature": 0, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": "Bearer sk-test"})
    deadline = time.monotonic() + 10
    while server.metric("mtl_serve_generated_tokens_total") == before:  # until it is generating
        assert time.monotonic() < deadline
        time.sleep(0.005)
    connection.close()
    server.wait_idle()
    time.sleep(0.2)  # nothing of it keeps running
    generated = server.metric("mtl_serve_generated_tokens_total") - before
    assert 1 <= generated < CONTEXT - 8, generated
    assert 'mtl_serve_requests_total{path="/v1/completions",status="499"} 1.0' in server.metrics_text()


def test_unknown_paths_share_one_metrics_label(server, http_call):
    for path in ("/nope", "/v1/nope/123", "/wp-login.php?x=1"):
        assert http_call(f"{server.url}{path}")[0] in (401, 404)
    text = server.metrics_text()
    assert "nope" not in text and "wp-login" not in text
    assert 'path="unmatched",status="404"' in text and 'path="unmatched",status="401"' in text


def test_api_key(server, client, http_call):
    http = http_call
    assert http(f"{server.url}/v1/models")[0] == 401
    assert http(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert http(f"{server.url}/health")[0] == 200  # probes need no key
    assert [m.id for m in client.models.list()] == ["tiny"]


@pytest.mark.parametrize("body, param", [
    ({"model": "other", "prompt": "hi"}, "model"),
    ({"model": "tiny", "prompt": "hi " * CONTEXT}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny"}, "prompt"),
    ('{"model": "tiny", "prompt": ', "body"),
], ids=["model", "long-prompt", "max-tokens", "type", "top-p", "missing", "json"])
def test_bad_requests_get_400_naming_the_field(server, http_call, body, param):
    status, text = http_call(f"{server.url}/v1/completions", body, {"Authorization": "Bearer sk-test"})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_the_server_keeps_serving_after_errors(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
