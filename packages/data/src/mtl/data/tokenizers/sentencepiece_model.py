"""A SentencePiece ``.model`` file run by the ``sentencepiece`` library."""

from __future__ import annotations

from typing import Sequence

import sentencepiece

from mtl.core.errors import DataError
from mtl.data.tokenizers.base import require_model_file


class SentencePieceTokenizer:
    """Ids as the model assigns them; ``eod`` is the model's ``</s>`` (eos) id."""

    def __init__(self, model_path: str):
        try:
            self.model = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"tokenizer 'sentencepiece': cannot read {model_path}: {exc}") from exc
        self.vocab_size = self.model.vocab_size()
        self.eod = self.model.eos_id()
        if self.eod < 0:
            raise DataError(
                f"tokenizer 'sentencepiece': {model_path} defines no end-of-sentence piece "
                "(eos_id = -1); train it with eos_id set"
            )

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.model.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode([int(i) for i in ids])


def build_sentencepiece_tokenizer(model_path: str | None) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(
        require_model_file(model_path, "sentencepiece", "a SentencePiece .model file"))
