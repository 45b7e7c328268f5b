"""Sentence splitting for ``mtl preprocess --split-sentences``, with NLTK's Punkt as Megatron.

Megatron's ``tools/preprocess_data.py --split-sentences`` runs NLTK's Punkt with the trained
English parameters (the ``punkt`` data, fetched by ``nltk.download``, not from the package
registry). We use the same ``PunktSentenceTokenizer``: with those trained parameters when
NLTK's data is installed (then the sentences are Megatron's), else untrained, which splits at
the same sentence-ending punctuation but has learned no abbreviations ("Mr." ends a sentence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtl.core.errors import DataError

NLTK_INSTALL = "pip install 'mtl-data[sentences]' (or: pip install nltk)"
# Megatron splits a document's text in slices of this many characters before Punkt sees it
# (Punkt's regular expressions are slow on one huge string); the slices' sentences are joined.
MAX_SPLIT_CHARS = 1_000_000


@dataclass(frozen=True)
class SentenceSplitter:
    """``split(text)`` -> sentences; ``description`` says which Punkt parameters it uses."""

    punkt: Any
    description: str

    def split(self, text: str) -> list[str]:
        return [sentence for start in range(0, len(text), MAX_SPLIT_CHARS)
                for sentence in self.punkt.tokenize(text[start: start + MAX_SPLIT_CHARS])]


def build_sentence_splitter(lang: str = "english") -> SentenceSplitter:
    """Punkt with NLTK's trained parameters for ``lang`` when installed, else untrained Punkt."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError:
        raise DataError(f"--split-sentences needs NLTK, which is not installed: {NLTK_INSTALL}") from None
    try:
        nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
    except LookupError:
        return SentenceSplitter(PunktSentenceTokenizer(),
                                f"NLTK Punkt, untrained (no punkt_tab/{lang} data installed)")
    return SentenceSplitter(nltk.tokenize.PunktTokenizer(lang), f"NLTK Punkt, trained ({lang})")
