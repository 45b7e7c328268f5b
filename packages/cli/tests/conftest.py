"""Fixtures for the CLI tests: an in-process runner of the ``mtl`` group, tiny configs, and a
checkpoint trained once per session. Every model here is 2 layers, 32 wide, 16 tokens long."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mtl.cli.main import cli

# A GPT-2-style model (learned positions, LayerNorm, GELU, biases, tied embeddings) on mock
# data: its parameter count is worked out by hand in test_train_dry_run.py.
TINY_TOML = """\
[model]
num_layers = 2
hidden_size = 32
num_attention_heads = 4
seq_length = 16
normalization = "layernorm"
activation = "gelu"
position_embedding = "learned"
bias = true
tie_embeddings = true

[data]
dataset = "mock"
tokenizer = "byte"

[train]
micro_batch_size = 2
global_batch_size = 4
iters = 2
lr = 1e-3
device = "cpu"

[ckpt]
save = "ckpt"

[logging]
dir = "logs"
"""


def run_mtl(*args: str):
    """``mtl ARGS`` in this process; the result has ``exit_code`` and ``output`` (stdout and
    stderr together)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=True)


@pytest.fixture
def mtl():
    return run_mtl


def assert_ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}\n{result.exception!r}"
    return result.output


def assert_clean_error(result, *needles: str) -> str:
    """Failed with a one-line ``error:`` message naming every needle, and no traceback."""
    out = result.output
    assert result.exit_code != 0, out
    # an exception other than SystemExit escaping the command is a traceback in a real shell
    assert isinstance(result.exception, SystemExit), f"{result.exception!r}\n{out}"
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in: {out}"
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh current directory (relative paths in configs land here)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tiny_toml(workdir) -> Path:
    path = workdir / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


@pytest.fixture(scope="session")
def trained_ckpt(tmp_path_factory) -> Path:
    """A checkpoint of the tiny model after 2 iterations on mock data (trained once)."""
    root = tmp_path_factory.mktemp("trained")
    (root / "tiny.toml").write_text(TINY_TOML)
    ckpt = root / "ckpt"
    result = run_mtl("train", root / "tiny.toml", "--set", f"ckpt.save={json.dumps(str(ckpt))}",
                     "--set", f"logging.dir={json.dumps(str(root / 'logs'))}")
    assert_ok(result)
    assert (ckpt / "latest").read_text().strip().endswith("2")
    return ckpt


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture
def ok():
    return assert_ok


@pytest.fixture
def clean_error():
    return assert_clean_error


@pytest.fixture
def jsonl():
    return write_jsonl


def make_word_tokenizer(size: int):
    """A Hugging Face fast tokenizer of WordPiece [PAD] [UNK] [CLS] [SEP] [MASK] and the words
    w0, w1, ... (``size`` tokens in all): small checkpoints' tokenizer files in conversion tests."""
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordPiece

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(size - 5))]
    inner = Tokenizer(WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


@pytest.fixture
def word_tokenizer():
    return make_word_tokenizer
