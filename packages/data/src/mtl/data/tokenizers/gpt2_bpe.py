"""GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``, run by the ``tokenizers`` library."""

from __future__ import annotations

import json
import os
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers

from mtl.core.errors import DataError
from mtl.data.tokenizers.base import require_model_file

EOD_TOKEN = "<|endoftext|>"


def locate_vocab_and_merges(model_path: str) -> tuple[str, str]:
    """(vocab.json, merges.txt) from a folder holding both or from the vocab.json path."""
    if os.path.isdir(model_path):
        vocab_path = os.path.join(model_path, "vocab.json")
        merges_path = os.path.join(model_path, "merges.txt")
    else:
        vocab_path = model_path
        merges_path = os.path.join(os.path.dirname(model_path), "merges.txt")
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer 'gpt2-bpe': {path} does not exist; data.tokenizer_model must be a "
                "folder holding vocab.json and merges.txt, or the vocab.json beside merges.txt"
            )
    return vocab_path, merges_path


class GPT2BPETokenizer:
    """Byte-level BPE with GPT-2's pre-tokenization regex and no added prefix space."""

    def __init__(self, model_path: str):
        vocab_path, merges_path = locate_vocab_and_merges(model_path)
        try:
            with open(vocab_path, encoding="utf-8") as f:
                vocab = json.load(f)
            bpe = models.BPE.from_file(vocab_path, merges_path)
        except Exception as exc:  # json and tokenizers both raise generic errors here
            raise DataError(f"tokenizer 'gpt2-bpe': cannot read {vocab_path} / {merges_path}: {exc}") from exc
        if EOD_TOKEN not in vocab:
            raise DataError(f"tokenizer 'gpt2-bpe': {vocab_path} has no '{EOD_TOKEN}' entry")
        self.model = HFTokenizerModel(bpe)
        self.model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self.model.decoder = decoders.ByteLevel()
        self.model.add_special_tokens([EOD_TOKEN])
        self.vocab_size = len(vocab)
        self.eod = vocab[EOD_TOKEN]

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.model.encode(t, add_special_tokens=False).ids for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode([int(i) for i in ids], skip_special_tokens=False)


def build_gpt2_bpe_tokenizer(model_path: str | None) -> GPT2BPETokenizer:
    path = require_model_file(model_path, "gpt2-bpe", "a folder with vocab.json and merges.txt")
    return GPT2BPETokenizer(path)
