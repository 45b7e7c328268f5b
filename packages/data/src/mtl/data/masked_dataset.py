"""What the bert and t5 datasets share: the sentence sample index, the config, the blend.

A sample is a run of whole sentences of one document (``sentence_sample_index``), drawn
again per sample with ``RandomState(seed + index)`` as Megatron-Core's MaskedWordPieceDataset
does, so a sample depends only on the corpus, split, seed, lengths and its index. Blends
follow Megatron's BlendedMegatronDatasetBuilder: each prefix gets ``ceil(ceil(N * w) * 1.005)``
samples and the blend ``sum(ceil(N * w))``, interleaved by the greedy rule of blended_dataset.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from mtl.core.errors import ConfigError, DataError
from mtl.data.blended_dataset import (
    SPLITS, BlendedDataset, parse_data_paths, parse_split, split_document_ranges,
)
from mtl.data.index_cache import load_or_build
from mtl.data.indexed_dataset import IndexedDataset
from mtl.data.masked_vocabulary import MaskedVocabulary
from mtl.data.masking import MaskingSettings
from mtl.data.sentence_sample_index import build_sentence_sample_index

# Megatron-Core's mid_level_dataset_surplus: components hold a little more than their share
BLEND_SURPLUS = 0.005


class MaskedDataset(torch.utils.data.Dataset):
    """Base of the bert and t5 datasets: ``sample_sentences(idx)`` -> (sentences, target
    length, its RandomState). ``index_seq_length`` is the length the sample index packs
    sentences to (the sequence length less the special tokens the sample adds)."""

    kind = "masked"

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], num_samples: int | None,
                 seq_length: int, index_seq_length: int, min_sentences: int, seed: int,
                 settings: MaskingSettings, vocabulary: MaskedVocabulary, cache_dir: str, name: str):
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.settings, self.vocabulary = settings, vocabulary
        first_doc, end_doc = document_range
        bounds = np.asarray(indexed.document_indices[first_doc: end_doc + 1], dtype=np.int64)
        description = {
            "kind": self.kind, "version": 1, "prefix": os.path.abspath(indexed.prefix),
            "idx_bytes": os.path.getsize(indexed.idx_path), "documents": [first_doc, end_doc],
            "seq_length": index_seq_length, "min_sentences": min_sentences, "seed": seed,
            "num_samples": num_samples, "short_seq_prob": settings.short_sequence_probability,
        }
        where = f"{indexed.prefix} ({name} split, documents {first_doc}..{end_doc})"
        (self.sample_index,), self.loaded_from_cache = load_or_build(
            cache_dir, description, ("sample_index",),
            lambda: (build_sentence_sample_index(bounds, indexed.sequence_lengths, num_samples,
                                                 index_seq_length, settings.short_sequence_probability,
                                                 seed, min_sentences, where),))

    def __len__(self) -> int:
        return len(self.sample_index)

    def sample_sentences(self, idx: int) -> tuple[list[np.ndarray], int, np.random.RandomState]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range ({len(self)} samples)")
        first, end, target_length = (int(v) for v in self.sample_index[idx])
        sentences = [self.indexed.get(i) for i in range(first, end)]
        return sentences, target_length, np.random.RandomState(seed=(self.seed + idx) % 2**32)


def masking_settings(data) -> MaskingSettings:
    """The data section's masking keys, checked (they reach here resolved)."""
    if not 0.0 < data.mask_prob < 1.0:
        raise ConfigError(f"data.mask_prob = {data.mask_prob} must be between 0 and 1 (exclusive), e.g. 0.15")
    if not 0.0 <= data.short_seq_prob <= 1.0:
        raise ConfigError(f"data.short_seq_prob = {data.short_seq_prob} must be between 0 and 1")
    if data.masking_max_ngram < 1:
        raise ConfigError(f"data.masking_max_ngram = {data.masking_max_ngram} must be at least 1")
    return MaskingSettings(data.mask_prob, data.short_seq_prob, data.masking_max_ngram,
                           data.masking_do_full_word, data.masking_use_longer_ngrams,
                           data.masking_use_geometric_distribution)


def build_masked_split(config, split: str, num_samples: int | None, make_component):
    """One dataset per ``data.paths`` prefix (``make_component(indexed, range, samples, split)``),
    blended as Megatron-Core blends them."""
    if split not in SPLITS:
        raise ConfigError(f"dataset split {split!r} is not one of {', '.join(SPLITS)}")
    data = config.data
    weighted = parse_data_paths(data.paths)
    shares = parse_split(data.split)
    cache_dir = data.cache_dir or os.path.join(
        os.path.dirname(os.path.abspath(weighted[0][1])), "mtl_index_cache")

    def component(prefix: str, samples: int | None):
        indexed = IndexedDataset(prefix)
        first, end = split_document_ranges(indexed.num_documents, shares)[SPLITS.index(split)]
        if first == end:
            raise DataError(f"{prefix}: data.split = {data.split!r} leaves the {split} split "
                            f"no documents (of {indexed.num_documents}); raise its share")
        return make_component(indexed, (first, end), samples, split, cache_dir)

    if len(weighted) == 1:
        return component(weighted[0][1], num_samples)
    if num_samples is None:
        num_samples = sum(len(component(prefix, None)) for _, prefix in weighted)
    targets = [int(math.ceil(num_samples * weight)) for weight, _ in weighted]
    datasets = [component(prefix, int(math.ceil(target * (1 + BLEND_SURPLUS))))
                for target, (_, prefix) in zip(targets, weighted)]
    description = {"prefixes": [os.path.abspath(p) for _, p in weighted], "split": split,
                   "data_split": data.split, "kind": datasets[0].kind,
                   "seq_length": datasets[0].seq_length, "seed": config.train.seed}
    return BlendedDataset(datasets, [w for w, _ in weighted], sum(targets), cache_dir, description)
