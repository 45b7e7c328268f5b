"""A tiktoken-format BPE file (one ``base64(token) rank`` per line) run by ``tiktoken``."""

from __future__ import annotations

import base64
import binascii
import os
from typing import Sequence

import tiktoken

from mtl.core.errors import DataError
from mtl.data.tokenizers.base import require_model_file

# The split regexes of OpenAI's public encodings (facts of the format, needed to match them).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)
EOD_TOKEN = "<|endoftext|>"


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """token bytes -> rank, with a ``DataError`` naming the line that is malformed."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError(f"expected 2 fields, got {len(parts)}")
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (ValueError, binascii.Error) as exc:
                raise DataError(
                    f"tokenizer 'tiktoken': {path} line {line_no} is not 'base64token rank': {exc}"
                ) from exc
    if not ranks:
        raise DataError(f"tokenizer 'tiktoken': {path} holds no tokens")
    return ranks


class TiktokenTokenizer:
    """The BPE ranks of the file plus one added special token, ``<|endoftext|>``, as ``eod``."""

    def __init__(self, model_path: str, pattern: str = CL100K_PATTERN):
        ranks = read_tiktoken_ranks(model_path)
        self.eod = max(ranks.values()) + 1
        self.vocab_size = self.eod + 1
        self.model = tiktoken.Encoding(
            name=os.path.basename(model_path),
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={EOD_TOKEN: self.eod},
        )

    def encode(self, text: str) -> list[int]:
        # Special-token text inside a document is ordinary text, never a control id.
        return self.model.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.model.encode_ordinary(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode([int(i) for i in ids])


def build_tiktoken_tokenizer(model_path: str | None) -> TiktokenTokenizer:
    return TiktokenTokenizer(
        require_model_file(model_path, "tiktoken", "a tiktoken BPE file (base64 token + rank per line)"))
