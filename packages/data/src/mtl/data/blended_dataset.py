"""``data.paths`` with weights and ``data.split``: the datasets a run trains and evaluates on.

``data.paths`` is ``["prefix"]`` or ``[[0.7, "a"], [0.3, "b"]]``; weights are normalised.
``data.split = "98,1,1"`` divides the documents of every prefix into train/valid/test.
Samples are interleaved by Megatron's greedy rule: sample i comes from the dataset whose
realised count lags its target share ``weight * i`` the most, so proportions track weights
at every prefix of the stream, not only on average.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from mtl.core.errors import ConfigError, DataError
from mtl.data.dataset_family import check_family
from mtl.data.gpt_dataset import GPTDataset
from mtl.data.index_cache import load_or_build
from mtl.data.indexed_dataset import IndexedDataset

SPLITS = ("train", "valid", "test")
# Each component is built with a little more than its share of samples so the greedy
# interleaving never runs past its end (Megatron-Core's default surplus).
SURPLUS = 0.005


def parse_data_paths(paths: list) -> list[tuple[float, str]]:
    """[(normalised weight, prefix)] from either accepted form of ``data.paths``."""
    if not paths:
        raise ConfigError("data.paths is empty; set it to a preprocessed prefix (the path of "
                          "P.bin/P.idx without the suffix) or use data.dataset = 'mock'")
    pairs: list[tuple[float, str]] = []
    for entry in paths:
        if isinstance(entry, str):
            pairs.append((1.0, entry))
        elif (isinstance(entry, (list, tuple)) and len(entry) == 2
              and isinstance(entry[0], (int, float)) and isinstance(entry[1], str)):
            pairs.append((float(entry[0]), entry[1]))
        else:
            raise ConfigError(f"data.paths entry {entry!r} is neither a prefix string nor "
                              "[weight, prefix]")
    if any(isinstance(e, str) for e in paths) and len(paths) > 1:
        raise ConfigError("data.paths with several prefixes needs a weight for each: "
                          '[[0.7, "a"], [0.3, "b"]]')
    if any(w <= 0 for w, _ in pairs):
        raise ConfigError(f"data.paths weights must be positive, got {[w for w, _ in pairs]}")
    total = sum(w for w, _ in pairs)
    return [(w / total, prefix) for w, prefix in pairs]


def parse_split(split: str) -> list[float]:
    """"98,1,1" -> [0.98, 0.01, 0.01]; fewer than three parts leave the rest empty."""
    try:
        parts = [float(p) for p in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data.split = {split!r} is not comma-separated numbers like '98,1,1'") from None
    if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data.split = {split!r} needs up to three non-negative numbers "
                          "(train, valid, test) with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_document_ranges(num_documents: int, shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous [first, end) document ranges per split, as Megatron-Core rounds them."""
    bounds = np.concatenate([[0.0], np.cumsum(shares)])
    bounds[-1] = 1.0  # no float drift past the last document
    return [(int(round(bounds[i] * num_documents)), int(round(bounds[i + 1] * num_documents)))
            for i in range(len(shares))]


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of sample i, its index within that dataset), by greedy error minimisation.

    Plain Python floats: for the handful of datasets of a blend this loop is several times
    faster than numpy's per-call overhead, and the result is cached on disk."""
    weight_list = [float(w) for w in weights]
    counts = [0] * len(weight_list)
    chosen_per_sample = [0] * size
    index_within = [0] * size
    for i in range(size):
        scale = float(max(i, 1))
        # target minus realised count; the first maximum wins ties, as in Megatron-Core
        best, best_error = 0, weight_list[0] * scale - counts[0]
        for d in range(1, len(weight_list)):
            error = weight_list[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen_per_sample[i] = best
        index_within[i] = counts[best]
        counts[best] += 1
    return np.asarray(chosen_per_sample, dtype=np.int16), np.asarray(index_within, dtype=np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(self, datasets: list[torch.utils.data.Dataset], weights: list[float], size: int,
                 cache_dir: str, description: dict):
        self.datasets = datasets
        self.weights = np.asarray(weights, dtype=np.float64)
        (self.dataset_index, self.dataset_sample_index), _ = load_or_build(
            cache_dir, {"kind": "blend", "size": size, "weights": list(weights), **description},
            ("dataset_index", "dataset_sample_index"),
            lambda: build_blending_indices(self.weights, size))
        for d, dataset in enumerate(datasets):
            used = int(np.sum(self.dataset_index == d))
            if used > len(dataset):
                raise DataError(f"blend component {d} has {len(dataset)} samples but {used} are needed")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]


def build_gpt_dataset(config, tokenizer, split: str, num_samples: int | None = None):
    """The registered ``gpt`` dataset: one GPTDataset, or a blend of one per prefix.

    ``num_samples`` None gives one epoch of each prefix's split."""
    del tokenizer  # tokens are already ids; the vocabulary was fixed at preprocessing
    check_family(config, "gpt")
    if split not in SPLITS:
        raise ConfigError(f"dataset split {split!r} is not one of {', '.join(SPLITS)}")
    data, seq_length, seed = config.data, config.model.seq_length, config.train.seed
    weighted = parse_data_paths(data.paths)
    split_id = SPLITS.index(split)
    shares = parse_split(data.split)
    cache_dir = data.cache_dir or os.path.join(
        os.path.dirname(os.path.abspath(weighted[0][1])), "mtl_index_cache")

    def component(prefix: str, samples: int | None) -> GPTDataset:
        indexed = IndexedDataset(prefix)
        first, end = split_document_ranges(indexed.num_documents, shares)[split_id]
        if first == end:
            raise DataError(f"{prefix}: data.split = {data.split!r} leaves the {split} split "
                            f"no documents (of {indexed.num_documents}); raise its share")
        return GPTDataset(indexed, (first, end), seq_length, samples, seed, cache_dir, split)

    if len(weighted) == 1:
        return component(weighted[0][1], num_samples)
    if num_samples is None:
        one_epoch = [len(component(prefix, None)) for _, prefix in weighted]
        num_samples = int(sum(one_epoch))
    # greedy interleaving takes at most ceil(weight * N) + 1 samples from a component
    datasets = [component(prefix, max(int(math.ceil(math.ceil(num_samples * weight) * (1 + SURPLUS))),
                                       int(math.ceil(num_samples * weight)) + 1))
                for weight, prefix in weighted]
    description = {"prefixes": [os.path.abspath(p) for _, p in weighted], "split": split,
                   "data_split": data.split, "seq_length": seq_length, "seed": seed}
    return BlendedDataset(datasets, [w for w, _ in weighted], num_samples, cache_dir, description)
