"""Megatron-style GPT samples over an indexed dataset: fixed-length windows across documents.

Three index arrays decide every sample (all built with vectorised numpy, cached on disk):

- document index ``[epochs * D]``: the D sequences of this split repeated for as many epochs
  as the requested samples need, shuffled;
- sample index ``[N + 1, 2]``: (position in the document index, token offset) where sample i
  starts; sample i spans from row i to row i+1 inclusive, i.e. ``seq_length + 1`` tokens, so
  consecutive samples share one boundary token (it is a label of one and an input of the next);
- shuffle index ``[N]``: the order in which samples are served.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from mtl.core.errors import DataError
from mtl.data.index_cache import load_or_build
from mtl.data.indexed_dataset import IndexedDataset

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs whose tokens give ``num_samples`` windows of ``seq_length + 1`` tokens."""
    if num_samples is None:
        return 1
    # e epochs give (e * T - 1) // seq_length samples (each needs one extra label token)
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def build_gpt_indices(sequence_lengths: np.ndarray, sequence_ids: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for the sequences ``sequence_ids``.

    Same arrays as Megatron-Core's GPTDataset for the same seed: when fewer than 80% of the
    last epoch's samples are needed, that epoch is shuffled (documents and samples) apart from
    the others and served last, so the full epochs see every document equally often."""
    rng = np.random.RandomState(seed)
    tokens_per_epoch = int(sequence_lengths[sequence_ids].sum(dtype=np.int64))
    num_epochs = epochs_needed(tokens_per_epoch, seq_length, num_samples)
    samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    separate_final_epoch = num_epochs > 1 and (
        num_samples - samples_before_final_epoch < int(0.8 * ((tokens_per_epoch - 1) // seq_length)))

    def shuffled(array: np.ndarray) -> np.ndarray:
        rng.shuffle(array)
        return array

    ids = sequence_ids.astype(np.int64)
    if separate_final_epoch:
        document_index = np.concatenate([shuffled(np.tile(ids, num_epochs - 1)), shuffled(ids.copy())])
    else:
        document_index = shuffled(np.tile(ids, num_epochs))  # [epochs * D]

    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths_in_order = sequence_lengths[document_index].astype(np.int64)
    document_ends = np.cumsum(lengths_in_order)  # exclusive end of each document, in tokens
    # Sample i starts at global token i * seq_length; the document holding token p is the
    # first whose end exceeds p (searchsorted 'right' also skips empty documents).
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(document_ends, starts, side="right")
    offset = starts - (document_ends[position] - lengths_in_order[position])
    sample_index = np.stack([position, offset], axis=1)  # [N + 1, 2]

    first_block = samples_before_final_epoch if separate_final_epoch else total_samples
    shuffle_index = shuffled(np.arange(first_block, dtype=np.int64))
    if first_block < total_samples:
        shuffle_index = np.concatenate(
            [shuffle_index, shuffled(np.arange(first_block, total_samples, dtype=np.int64))])
    return document_index, sample_index, shuffle_index


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``{"tokens", "labels", "loss_mask"}`` of length ``seq_length`` from the
    documents ``document_range = (first, end)`` of ``indexed``."""

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int,
                 num_samples: int | None, seed: int, cache_dir: str, name: str = "train"):
        self.indexed = indexed
        self.seq_length = seq_length
        first_doc, end_doc = document_range
        sequence_ids = np.arange(indexed.document_indices[first_doc],
                                 indexed.document_indices[end_doc], dtype=np.int64)
        tokens = int(indexed.sequence_lengths[sequence_ids].sum(dtype=np.int64))
        if tokens <= seq_length:
            raise DataError(
                f"{indexed.prefix}: the {name} split (documents {first_doc}..{end_doc}) holds "
                f"{tokens} tokens, fewer than one sample of seq_length + 1 = {seq_length + 1}; "
                "use more data, a shorter model.seq_length, or a larger share in data.split"
            )
        description = {
            "kind": "gpt", "version": 1, "prefix": os.path.abspath(indexed.prefix),
            "idx_bytes": os.path.getsize(indexed.idx_path), "documents": [first_doc, end_doc],
            "seq_length": seq_length, "seed": seed, "num_samples": num_samples, "split": name,
        }
        arrays, self.loaded_from_cache = load_or_build(
            cache_dir, description, INDEX_NAMES,
            lambda: build_gpt_indices(indexed.sequence_lengths, sequence_ids, seq_length,
                                      num_samples, seed))
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of (shuffled) sample ``idx``."""
        j = int(self.shuffle_index[idx])
        first_pos, first_offset = (int(v) for v in self.sample_index[j])
        last_pos, last_offset = (int(v) for v in self.sample_index[j + 1])
        doc = self.document_index
        if first_pos == last_pos:
            return np.asarray(self.indexed.get(int(doc[first_pos]), first_offset,
                                               last_offset - first_offset + 1), dtype=np.int64)
        pieces = [self.indexed.get(int(doc[first_pos]), first_offset)]
        pieces += [self.indexed.get(int(doc[p])) for p in range(first_pos + 1, last_pos)]
        pieces.append(self.indexed.get(int(doc[last_pos]), 0, last_offset + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range ({len(self)} samples)")
        window = torch.from_numpy(self.sample_tokens(idx))  # [s + 1]
        return {
            "tokens": window[:-1].clone(),  # [s]
            "labels": window[1:].clone(),  # [s], next token of each position
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
        }
