"""Deterministic random-token samples: a dataset that needs no files (smoke tests, benchmarks)."""

from __future__ import annotations

import numpy as np
import torch

from mtl.core.errors import ConfigError

SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample i is uniform random ids seeded by (seed, split, i): independent of access order."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 split: str = "train"):
        if split not in SPLIT_IDS:
            raise ConfigError(f"dataset split {split!r} is not one of {', '.join(SPLIT_IDS)}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split_id = seed, SPLIT_IDS[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range ({self.num_samples} samples)")
        rng = np.random.default_rng([self.seed, self.split_id, idx])
        window = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1))  # [s + 1]
        return {
            "tokens": window[:-1].clone(),
            "labels": window[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
        }


def build_mock_dataset(config, tokenizer, split: str, num_samples: int | None = None) -> MockGPTDataset:
    """The registered ``mock`` dataset; ``num_samples`` defaults to ``data.mock_num_samples``."""
    samples = config.data.mock_num_samples if num_samples is None else num_samples
    return MockGPTDataset(samples, config.model.seq_length, tokenizer.vocab_size,
                          config.train.seed, split)
