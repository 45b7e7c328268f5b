"""A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library."""

from __future__ import annotations

import json
import os
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizerModel

from mtl.core.errors import DataError
from mtl.data.tokenizers.base import require_model_file

# Tried in order when the tokenizer's config does not name its end-of-sequence token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class HuggingFaceTokenizer:
    """Wraps ``tokenizers.Tokenizer``; special tokens are not added on encode."""

    def __init__(self, model_path: str):
        json_path = os.path.join(model_path, "tokenizer.json") if os.path.isdir(model_path) else model_path
        if not os.path.isfile(json_path):
            raise DataError(f"tokenizer 'hf': {json_path} does not exist; point "
                            "data.tokenizer_model at a tokenizer.json or the folder holding one")
        try:
            self.model = HFTokenizerModel.from_file(json_path)
        except Exception as exc:  # the library raises a bare Exception on a malformed file
            raise DataError(f"tokenizer 'hf': cannot read {json_path}: {exc}") from exc
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        self.special_tokens = self._declared_special_tokens(json_path)
        self.eod = self._find_eod(json_path)

    @staticmethod
    def _declared_special_tokens(json_path: str) -> dict[str, str]:
        """Role -> token its ``tokenizer_config.json`` names (``{"cls": "[CLS]", ...}``), if any."""
        config_path = os.path.join(os.path.dirname(json_path), "tokenizer_config.json")
        if not os.path.isfile(config_path):
            return {}
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        declared = {}
        for key, token in config.items():
            if isinstance(token, dict):  # {"content": "</s>", ...} in older configs
                token = token.get("content")
            if key.endswith("_token") and isinstance(token, str):
                declared[key.removesuffix("_token")] = token
        return declared

    def _find_eod(self, json_path: str) -> int:
        candidates = list(EOD_CANDIDATES)
        if "eos" in self.special_tokens:
            candidates.insert(0, self.special_tokens["eos"])
        for token in candidates:
            token_id = self.model.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(
            f"tokenizer 'hf': {json_path} has no end-of-document token (looked for "
            f"{', '.join(candidates)}); add one to the tokenizer's special tokens"
        )

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.model.encode(t, add_special_tokens=False).ids for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.model.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.model.id_to_token(int(token_id))


def build_hf_tokenizer(model_path: str | None) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(require_model_file(model_path, "hf", "a tokenizer.json file"))
