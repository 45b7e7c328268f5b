"""A tokenizer with no model file: UTF-8 bytes 0..255 and one end-of-document id, 256."""

from __future__ import annotations

from typing import Sequence


class ByteTokenizer:
    """Each UTF-8 byte is a token; 256 ends a document (vocabulary 257)."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # The end-of-document id has no text; a cut multi-byte character decodes to U+FFFD.
        return bytes(int(i) for i in ids if int(i) != self.eod).decode("utf-8", errors="replace")


def build_byte_tokenizer(model_path: str | None = None) -> ByteTokenizer:
    del model_path  # needs no file
    return ByteTokenizer()
