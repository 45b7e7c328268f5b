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

    @property
    def special_tokens(self) -> dict[str, str]:
        """Role -> piece of the roles the model was trained with (bos, eos, pad, unk)."""
        ids = {"bos": self.model.bos_id(), "eos": self.model.eos_id(), "pad": self.model.pad_id(),
               "unk": self.model.unk_id()}
        return {role: self.model.id_to_piece(i) for role, i in ids.items() if i >= 0}

    def token_to_id(self, token: str) -> int | None:
        """The piece's id; None for a piece the model does not hold (it would map to unk)."""
        token_id = self.model.piece_to_id(token)
        return None if token_id == self.model.unk_id() and token != self.model.id_to_piece(token_id) else token_id

    def id_to_token(self, token_id: int) -> str | None:
        return self.model.id_to_piece(int(token_id))


def build_sentencepiece_tokenizer(model_path: str | None) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(
        require_model_file(model_path, "sentencepiece", "a SentencePiece .model file"))
