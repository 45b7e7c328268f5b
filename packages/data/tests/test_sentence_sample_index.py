"""The masked datasets' sample index equals Megatron-Core's compiled ``build_mapping``; its
random streams are C++'s mt19937 / mt19937_64."""

import numpy as np
import pytest

from mtl.core.errors import DataError
from mtl.data.mersenne_twister import MT19937, MT19937_64, MersenneTwister
from mtl.data.sentence_sample_index import LONG_SENTENCE_LEN, build_sentence_sample_index

megatron_helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")


@pytest.mark.parametrize("params,expected", [(MT19937, 4123659995), (MT19937_64, 9981545732273789042)])
def test_mersenne_twisters_give_the_cpp_standards_10000th_output(params, expected):
    generator = MersenneTwister(5489, params)  # the C++ standard's default seed and check value
    for _ in range(9999):
        generator.next()
    assert generator.next() == expected


@pytest.mark.parametrize("num_samples,short_seq_prob,min_sentences,seed", [
    (500, 0.1, 2, 1234), (3000, 0.1, 1, 7), (None, 0.0, 2, 1), (100, 0.33, 2, 99)])
def test_sample_index_equals_megatron_build_mapping(num_samples, short_seq_prob, min_sentences, seed):
    rng = np.random.default_rng(seed)
    sentence_lengths = rng.integers(1, 60, 3000).astype(np.int32)
    sentence_lengths[17] = LONG_SENTENCE_LEN + 1  # its document (if of several sentences) is skipped
    sentences_per_document = rng.integers(0, 8, 600)  # empty and one-sentence documents too
    bounds = np.concatenate([[0], np.cumsum(sentences_per_document)])
    bounds = bounds[bounds <= len(sentence_lengths)][10:300].astype(np.int64)  # a split's documents
    ours = build_sentence_sample_index(bounds, sentence_lengths, num_samples, 61, short_seq_prob,
                                       seed, min_sentences)
    epochs, max_samples = (1, 2**63) if num_samples is None else (2**31 - 2, num_samples)
    theirs = megatron_helpers.build_mapping(bounds, sentence_lengths, epochs, max_samples, 61,
                                            short_seq_prob, seed, False, min_sentences)
    assert np.array_equal(ours, theirs.astype(np.int64))
    assert num_samples is None or len(ours) >= num_samples
    assert (ours[:, 2] <= 61).all() and (ours[:, 1] > ours[:, 0]).all()


def test_no_usable_document_is_an_error_not_an_endless_loop():
    one_sentence_documents = np.arange(11, dtype=np.int64)
    with pytest.raises(DataError, match="no document has 2 or more sentences"):
        build_sentence_sample_index(one_sentence_documents, np.full(10, 5, np.int32), 100, 61, 0.1, 1, 2)
