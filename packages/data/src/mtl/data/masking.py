"""Choosing the tokens a masked-LM sample predicts: Megatron-Core's n-gram masking, draw for draw.

Candidates are single tokens, or whole words (a token and its "##" pieces) with whole-word
masking; [CLS] and [SEP] never are. The candidates are shuffled, and each in turn starts an
n-gram of up to ``masking_max_ngram`` candidates (n drawn with probabilities proportional to
1/n, or from a geometric(0.2) law for SpanBERT / T5 spans), shortened until it fits the budget
of ``masking_probability`` of the tokens, and skipped when it overlaps one masked before.
Every draw comes from the sample's own ``numpy.random.RandomState`` in Megatron's order, so
the same seed masks the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mtl.data.masked_vocabulary import MaskedVocabulary


@dataclass(frozen=True)
class MaskingSettings:
    masking_probability: float
    short_sequence_probability: float
    masking_max_ngram: int
    masking_do_full_word: bool
    masking_use_longer_ngrams: bool
    masking_use_geometric_distribution: bool


@dataclass
class MaskedPredictions:
    tokens: list[int]  # the sample with its masked tokens replaced
    positions: list[int]  # masked positions, ascending
    labels: list[int]  # the original token at each masked position
    spans: list[tuple[list[int], list[int]]]  # (positions, original tokens) per n-gram, by start


def _candidates(token_ids: list[int], vocabulary: MaskedVocabulary, full_word: bool) -> list[list[int]]:
    candidates: list[list[int]] = []
    for i, token_id in enumerate(token_ids):
        if token_id == vocabulary.cls or token_id == vocabulary.sep:
            continue
        if vocabulary.is_continuation[token_id] and full_word and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    return candidates


def create_masked_lm_predictions(token_ids: list[int], target_sequence_length: int,
                                 rng: np.random.RandomState, settings: MaskingSettings,
                                 vocabulary: MaskedVocabulary,
                                 replacement: Callable[[np.random.RandomState], int | None]
                                 ) -> MaskedPredictions:
    """Mask ``token_ids``; ``replacement(rng)`` gives the id written over a masked token
    (None: keep the original)."""
    candidates = _candidates(token_ids, vocabulary, settings.masking_do_full_word)
    p = settings.masking_probability
    n_maskings = min(p * target_sequence_length, max(1, int(round(len(token_ids) * p))))
    ngram_sizes = np.arange(settings.masking_max_ngram, dtype=np.int64) + 1
    ngram_probs = 1.0 / ngram_sizes
    ngram_probs = ngram_probs / ngram_probs.sum(keepdims=True)
    if settings.masking_use_longer_ngrams:
        ngram_probs = ngram_probs[::-1]
    # per candidate, its n-grams of 1..max_ngram candidates (shorter near the end)
    candidate_ngrams = [[candidates[start: start + n] for n in ngram_sizes]
                        for start in range(len(candidates))]
    rng.shuffle(candidate_ngrams)

    masked_tokens = list(token_ids)
    masked: list[tuple[int, int]] = []
    spans: list[tuple[list[int], list[int]]] = []
    masked_positions: set[int] = set()
    for ngrams in candidate_ngrams:
        if len(masked) >= n_maskings:
            break
        if settings.masking_use_geometric_distribution:
            n = min(rng.geometric(0.2), settings.masking_max_ngram)
        else:
            probs = ngram_probs[: len(ngrams)] / ngram_probs[: len(ngrams)].sum(keepdims=True)
            n = rng.choice(ngram_sizes[: len(ngrams)], p=probs)
        while True:  # shorten the n-gram until it fits the budget
            positions = sum(ngrams[n - 1], [])
            n -= 1
            if n_maskings >= len(masked) + len(positions):
                break
            if n == 0:
                positions = None
                break
        if positions is None or any(i in masked_positions for i in positions):
            continue
        for i in positions:
            masked_positions.add(i)
            replacement_id = replacement(rng)
            masked_tokens[i] = token_ids[i] if replacement_id is None else replacement_id
            masked.append((i, token_ids[i]))
        spans.append((positions, [token_ids[i] for i in positions]))
    # Megatron shuffles the candidates once more here (for its permutation option, which we do
    # not offer); no draw follows it, so skipping it changes no sample.
    masked.sort(key=lambda pair: pair[0])
    spans.sort(key=lambda span: span[0][0])
    return MaskedPredictions(masked_tokens, [i for i, _ in masked], [t for _, t in masked], spans)
