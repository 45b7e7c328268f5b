"""Which sentences make each sample of a masked dataset: Megatron-Core's ``build_mapping``.

Walking the documents in order, sentences are gathered into a sample until it holds at least
its target length (and ``min_sentences``, and more than one sentence is left for the next
sample) or the document ends. The target is ``max_seq_length``, or with probability about
``short_seq_prob`` a random shorter length, drawn from ``std::mt19937(seed)``. Epochs repeat
until ``num_samples`` are reached (whole epochs, as Megatron), then the rows are shuffled
with ``std::mt19937_64(seed + 1)``. Same arrays as Megatron's C++ helper for the same inputs.
"""

from __future__ import annotations

import numpy as np

from mtl.core.errors import DataError
from mtl.data.mersenne_twister import MT19937, MT19937_64, MersenneTwister

# Documents of several sentences with one longer than this are skipped (Megatron's constant).
LONG_SENTENCE_LEN = 512


def _target_length(rng: MersenneTwister, short_seq_ratio: int, max_seq_length: int) -> int:
    if short_seq_ratio == 0:
        return max_seq_length
    draw = rng.next()
    return 2 + draw % (max_seq_length - 1) if draw % short_seq_ratio == 0 else max_seq_length


def _eligible_documents(document_bounds: np.ndarray, sequence_lengths: np.ndarray,
                        min_sentences: int) -> list[tuple[int, int]]:
    """(first, end) sentence of each document a sample may come from, in order."""
    eligible = []
    for first, end in zip(document_bounds[:-1].tolist(), document_bounds[1:].tolist()):
        count = end - first
        has_long = count > 1 and int(sequence_lengths[first:end].max()) > LONG_SENTENCE_LEN
        if count >= min_sentences and not has_long:
            eligible.append((first, end))
    return eligible


def build_sentence_sample_index(document_bounds: np.ndarray, sequence_lengths: np.ndarray,
                                num_samples: int | None, max_seq_length: int,
                                short_seq_prob: float, seed: int, min_sentences: int,
                                where: str = "the corpus") -> np.ndarray:
    """[N, 3] rows (first sentence, end sentence, target length), shuffled.

    ``document_bounds`` are the sentence indices where this split's documents start, plus the
    end of the last (Megatron's ``document_indices`` slice); ``num_samples`` None: one epoch."""
    if max_seq_length < 2:
        raise DataError(f"{where}: samples of {max_seq_length} tokens besides the special tokens "
                        "are too short; raise model.seq_length")
    # C's round(): half away from zero (1 / p is positive)
    short_seq_ratio = int(np.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    documents = _eligible_documents(np.asarray(document_bounds), sequence_lengths, min_sentences)
    lengths = sequence_lengths.tolist() if len(sequence_lengths) < 1 << 22 else sequence_lengths
    if not documents:
        raise DataError(f"{where}: no document has {min_sentences} or more sentences (each "
                        f"sentence at most {LONG_SENTENCE_LEN} tokens), so no sample can be made")
    rng = MersenneTwister(seed, MT19937)
    rows: list[tuple[int, int, int]] = []
    target_samples = 1 if num_samples is None else num_samples
    while len(rows) < target_samples:  # whole epochs, as Megatron's loop over epochs
        for first, end in documents:
            seq_len = num_sent = 0
            remaining = end - first
            start = first
            target = _target_length(rng, short_seq_ratio, max_seq_length)
            for sentence in range(first, end):
                seq_len += lengths[sentence]
                num_sent += 1
                remaining -= 1
                if (seq_len >= target and remaining > 1 and num_sent >= min_sentences) or remaining == 0:
                    rows.append((start, sentence + 1, target))
                    start = sentence + 1
                    target = _target_length(rng, short_seq_ratio, max_seq_length)
                    seq_len = num_sent = 0
        if num_samples is None:
            break
    index = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    shuffle_rng = MersenneTwister(seed + 1, MT19937_64)
    for i in range(len(index) - 1, 0, -1):  # Fisher-Yates from the end, as the C++ helper
        j = shuffle_rng.next() % (i + 1)
        index[[i, j]] = index[[j, i]]
    return index
