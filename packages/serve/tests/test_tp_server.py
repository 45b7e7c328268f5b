"""`torchrun --nproc-per-node 2 mtl serve CKPT --tp 2` on CPU (gloo), as the README says users
run it: rank 0 serves HTTP, rank 1 follows its steps, and the `openai` client gets one
process's greedy tokens, whole and streamed."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
import torch

from mtl.models.generate import generate
from mtl.serve.loading import load_checkpoint

PROMPTS = ["hello world", "the quick brown fox", "pack my box with five dozen liquor jugs"]


@pytest.fixture(scope="module")
def tp_server(checkpoint, start_server):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    srv = start_server(checkpoint["dir"], "--tp", "2", "--served-model-name", "tiny",
                       launcher=(torchrun, "--standalone", "--nproc-per-node", "2"))
    yield srv
    srv.terminate()  # rank 0 drains and tells rank 1 to stop; torchrun, signalled, exits non-zero
    assert "stopped" in srv.output()


def test_tp2_server_gives_one_process_greedy_tokens(checkpoint, tp_server):
    loaded = load_checkpoint(checkpoint["dir"], device=torch.device("cpu"))
    tok = loaded.tokenizer
    client = openai.OpenAI(base_url=f"{tp_server.url}/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        expected = generate(loaded.model, tok.encode(prompt), 12, temperature=0, eod=tok.eod)
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        assert reply.choices[0].logprobs.tokens == [tok.decode([i]) for i in expected]
        assert reply.choices[0].text == tok.decode(expected)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    expected = generate(loaded.model, tok.encode(PROMPTS[0]), 12, temperature=0, eod=tok.eod)
    assert "".join(chunk.choices[0].text for chunk in stream) == tok.decode(expected)
