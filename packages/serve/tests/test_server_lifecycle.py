"""A server with room for one running and one waiting request, and a tokenizer without a chat
template: 429 on overload (and serving again after), 400 for chat, and SIGTERM letting the
running stream finish before the process exits 0."""

from __future__ import annotations


import openai
import pytest

LONG = 120  # tokens: a request that is still running while the test acts


@pytest.fixture(scope="module")
def small_server(checkpoint, start_server):
    srv = start_server(checkpoint["dir"], "--max-batch", "1", "--max-waiting", "1", "--served-model-name", "tiny",
                       "--tokenizer", "hf", "--tokenizer-model", checkpoint["plain_tokenizer"])
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def small_client(small_server):
    with openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="none", max_retries=0) as client:
        yield client


def long_stream(client):
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=LONG, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    return stream, chunks, first


def test_chat_without_a_template_is_a_400_naming_messages(small_client):
    with pytest.raises(openai.BadRequestError, match="no chat template") as err:
        small_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "messages"


def test_overload_answers_429_and_the_server_recovers(small_server, small_client):
    running, _, _ = long_stream(small_client)  # holds the one batch slot
    waiting = small_client.completions.create(model="tiny", prompt="hello", max_tokens=LONG, stream=True,
                                              extra_body={"ignore_eos": True})  # fills the queue
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        small_client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    running.close()
    waiting.close()
    small_server.wait_idle()  # the server sees each client gone when it next writes to it
    reply = small_client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 or reply.choices[0].finish_reason == "stop"
    assert 'status="429"' in small_server.metrics_text()


def test_sigterm_finishes_the_running_stream_and_exits_0(small_server, small_client):
    _, chunks, first = long_stream(small_client)
    small_server.process.send_signal(15)
    rest = list(chunks)
    assert 1 + len(rest) == LONG  # one chunk per token: every one was delivered
    assert rest[-1].choices[0].finish_reason == "length"
    assert small_server.process.wait(30) == 0
    assert "stopped" in small_server.output()
    with pytest.raises(openai.APIConnectionError):
        small_client.completions.create(model="tiny", prompt="hello", max_tokens=2)
