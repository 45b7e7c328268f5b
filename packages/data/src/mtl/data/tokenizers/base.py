"""The tokenizer protocol every mtl tokenizer follows, and the model-file check they share."""

from __future__ import annotations

import os
from typing import Protocol, Sequence, runtime_checkable

from mtl.core.errors import DataError


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. ``eod`` is the id appended between documents.

    Implementations may also offer ``encode_batch(texts) -> list[list[int]]``; the
    preprocessing pipeline uses it when present. Those with a vocabulary of named tokens
    (``hf``, ``sentencepiece``) offer ``token_to_id(token) -> int | None``,
    ``id_to_token(id) -> str | None`` and ``special_tokens`` (role -> token, e.g.
    ``{"cls": "[CLS]"}``, as the tokenizer's files declare them): the bert and t5 datasets
    find their [CLS], [SEP], [MASK], [PAD] and sentinel tokens through them.
    """

    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def require_model_file(model_path: str | os.PathLike | None, tokenizer_name: str,
                       what: str) -> str:
    """The model path as a string, or a ``DataError`` saying what is missing and how to fix it.

    ``what`` describes the expected file (e.g. "a SentencePiece .model file")."""
    if model_path is None or str(model_path) == "":
        raise DataError(
            f"tokenizer '{tokenizer_name}' needs {what}; set data.tokenizer_model "
            f"(or --tokenizer-model) to its path"
        )
    path = os.fspath(model_path)
    if not os.path.exists(path):
        raise DataError(
            f"tokenizer '{tokenizer_name}': model file {path} does not exist; "
            f"set data.tokenizer_model to {what}"
        )
    return path
