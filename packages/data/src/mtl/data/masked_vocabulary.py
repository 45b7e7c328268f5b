"""The named tokens a masked-LM dataset needs, found in the run's tokenizer.

BERT's samples need [CLS], [SEP], [MASK] and [PAD]; T5's need a decoder start token, an end
token and sentinels (``<extra_id_0>``, ``<extra_id_1>``, ... in that order). Each role is
looked up as the tokenizer's files declare it (``tokenizer_config.json``'s ``cls_token``, a
SentencePiece model's bos/eos/pad), else under the usual spellings. Whole-word masking asks
which tokens continue a word: WordPiece marks them with a leading ``##``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtl.core.errors import DataError

ROLE_SPELLINGS = {
    "cls": ("[CLS]", "<cls>"), "sep": ("[SEP]", "<sep>"), "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>"), "bos": ("[BOS]", "<s>", "<bos>"), "eos": ("[EOS]", "</s>", "<eos>"),
}
# Megatron's samples fill padding with this id where the vocabulary has no distinct pad token
NO_PAD_ID = -1
SENTINEL_LIMIT = 1000  # more spans than this in one sample is not a T5 setting


@dataclass(frozen=True)
class MaskedVocabulary:
    size: int
    cls: int | None
    sep: int | None
    mask: int | None
    pad: int  # NO_PAD_ID where the tokenizer has none, or it is also eos/eod (Megatron's rule)
    bos: int | None
    eos: int | None
    sentinels: tuple[int, ...]
    is_continuation: np.ndarray  # bool [size]: the token continues the word before it ("##")


def _role_id(tokenizer, role: str) -> int | None:
    declared = getattr(tokenizer, "special_tokens", {}).get(role)
    for token in ((declared,) if declared else ()) + ROLE_SPELLINGS[role]:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


def masked_vocabulary(tokenizer, tokenizer_name: str, dataset: str) -> MaskedVocabulary:
    """The ids of every role; ``DataError`` for a tokenizer without a vocabulary of named tokens."""
    if not hasattr(tokenizer, "token_to_id"):
        raise DataError(f"data.dataset = '{dataset}' needs a vocabulary of named tokens "
                        f"([CLS], [MASK], sentinels), which tokenizer '{tokenizer_name}' has not; set "
                        "data.tokenizer = 'hf' (a WordPiece tokenizer.json) or 'sentencepiece'")
    ids = {role: _role_id(tokenizer, role) for role in ROLE_SPELLINGS}
    sentinels = []
    while len(sentinels) < SENTINEL_LIMIT:
        token_id = tokenizer.token_to_id(f"<extra_id_{len(sentinels)}>")
        if token_id is None:
            break
        sentinels.append(int(token_id))
    size = int(tokenizer.vocab_size)
    pieces = [tokenizer.id_to_token(i) or "" for i in range(size)]
    pad = ids["pad"]
    if pad is None or pad in (ids["eos"], getattr(tokenizer, "eod", None)):
        pad = NO_PAD_ID
    return MaskedVocabulary(size, ids["cls"], ids["sep"], ids["mask"], pad, ids["bos"], ids["eos"],
                            tuple(sentinels), np.asarray([p.startswith("##") for p in pieces], dtype=bool))


def require_roles(vocabulary: MaskedVocabulary, roles: tuple[str, ...], tokenizer_model: str | None,
                  dataset: str) -> None:
    """One line naming every missing token and where to add it."""
    missing = [role for role in roles if getattr(vocabulary, role) is None]
    if missing:
        spelled = ", ".join(ROLE_SPELLINGS[role][0] for role in missing)
        raise DataError(f"data.dataset = '{dataset}': the vocabulary {tokenizer_model} has no "
                        f"{spelled} token; add {'it' if len(missing) == 1 else 'them'} to the "
                        "tokenizer's special tokens (or name it in tokenizer_config.json)")
