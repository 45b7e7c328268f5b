"""Fixtures: tiny models built in-process (engine tests), a tiny checkpoint with a real Hugging
Face tokenizer and chat template trained once by `mtl train`, and `mtl serve` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import urllib.error
import urllib.request
import pytest
import torch
from click.testing import CliRunner

from mtl.core.config_io import config_from_dict
from mtl.core.model_protocol import build_model
from mtl.core.plugins import registry
from mtl.parallel.testing import free_port
from mtl.parallel.topology import Topology
from mtl.serve.loading import LoadedModel

# Tiny models on shared cores: one thread each is many times faster than threads fighting over them.
torch.set_num_threads(1)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

CONTEXT = 256  # tokens: long enough that a request can still be running when a test acts on it
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello server", "pack my box with five dozen "
          "liquor jugs", "continuous batching over a paged cache", "tokens stream out one at a time"] * 20


def tiny_model(**model) -> LoadedModel:
    """A randomly initialised 2-layer model with the byte tokenizer, as the engine sees a loaded one."""
    cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                      "num_query_groups": 2, "seq_length": 64, "tie_embeddings": False, **model},
                            "data": {"tokenizer": "byte"}, "train": {"device": "cpu", "seed": 3}})
    tokenizer = registry("tokenizer").get("byte").build(None)
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=tokenizer.vocab_size)
    family, backend = registry("model family").get(cfg.model.family), registry("backend").get(cfg.model.backend)
    model = build_model(family, cfg, Topology.single(), backend).eval()
    return LoadedModel(model, tokenizer, cfg, Topology.single(), None)


@pytest.fixture
def make_model():
    return tiny_model


def _write_tokenizer(folder: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", **({"chat_template": template} if template else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def train_one_step(root: Path, model_and_data: str) -> str:
    """`mtl train` for one step (at a learning rate that leaves the init) of the ``[model]`` and
    ``[data]`` TOML given, on the CPU; the checkpoint directory, ``root/ckpt``."""
    from mtl.cli.main import cli

    (root / "run.toml").write_text(f"""{model_and_data}
[train]
micro_batch_size = 1
global_batch_size = 1
iters = 1
lr = 1e-9
device = "cpu"

[ckpt]
save = "{root / 'ckpt'}"

[logging]
dir = "{root / 'logs'}"
""")
    result = CliRunner().invoke(cli, ["train", str(root / "run.toml")])
    assert result.exit_code == 0, result.output
    return str(root / "ckpt")


@pytest.fixture(scope="session")
def train_checkpoint():
    return train_one_step


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> dict:
    """`mtl train` for one step at a learning rate that leaves the random init (varied text),
    with a BPE tokenizer whose tokenizer_config.json holds a chat template; also the same
    tokenizer without one."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = _write_tokenizer(root / "tokenizer", CHAT_TEMPLATE)
    plain = _write_tokenizer(root / "plain_tokenizer", None)
    train_one_step(root, f"""\
[model]
num_layers = 2
hidden_size = 32
num_attention_heads = 4
num_query_groups = 2
seq_length = {CONTEXT}
tie_embeddings = false

[data]
dataset = "mock"
tokenizer = "hf"
tokenizer_model = "{tokenizer}"
""")
    return {"dir": str(root / "ckpt"), "tokenizer": str(tokenizer), "plain_tokenizer": str(plain),
            "context": CONTEXT}


def http(url: str, body: dict | str | None = None, headers: dict | None = None) -> tuple[int, str]:
    """(status, body text) of a GET, or a POST of ``body`` (a dict as JSON, a str as it is)."""
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    """A `mtl serve` process on a free port of 127.0.0.1."""

    def __init__(self, checkpoint: str, *args: str, env: dict | None = None, launcher: tuple[str, ...] = ()):
        """``launcher``: what runs the `mtl` script (torchrun and its options), or nothing."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(checkpoint).parent / f"serve-{self.port}.log", "w+")
        command = [*launcher, str(Path(sys.executable).parent / "mtl"), "serve", checkpoint, "--port", str(self.port),
                   "--kv-memory", "8MiB", *args]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **ONE_THREAD, **(env or {})})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mtl serve exited {self.process.returncode}: {self.output()}"
            try:
                if http(f"{self.url}/health")[0] == 200:
                    return
            except OSError:  # not listening yet
                time.sleep(0.2)
        raise AssertionError(f"mtl serve did not come up: {self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metrics_text(self) -> str:
        return http(f"{self.url}/metrics")[1]

    def metric(self, name: str) -> float:
        for line in self.metrics_text().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        names = ("mtl_serve_kv_blocks_in_use", "mtl_serve_running_requests", "mtl_serve_queue_length")
        while any(self.metric(name) for name in names):
            assert time.monotonic() < deadline, f"still busy: {[self.metric(name) for name in names]}"
            time.sleep(0.05)

    def terminate(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@pytest.fixture(scope="session")
def http_call():
    return http


@pytest.fixture(scope="session")
def start_server():
    return Server


@pytest.fixture(scope="module")
def server(checkpoint):
    """The checkpoint served with an API key (the environment variable's)."""
    srv = Server(checkpoint["dir"], "--served-model-name", "tiny", env={"MTL_API_KEY": "sk-test"})
    yield srv
    assert srv.terminate() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
