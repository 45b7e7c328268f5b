"""Seeding every random stream a training run draws from, and re-seeding on resume."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from mtl.parallel.random import seed_everything as seed_rng_streams
from mtl.parallel.topology import Topology


def seed_everything(seed: int, topology: Topology, device: torch.device) -> None:
    """Python, NumPy, torch, and the tensor-parallel dropout streams (Megatron's rules:
    pipeline stages offset the default seed, TP ranks get their own model-parallel stream)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    seed_rng_streams(seed, topology, device)


def resume_seed(seed: int, iteration: int) -> int:
    """A seed for the RNG streams of a run resumed at another layout: a function of the run's
    seed and the iteration, so the resumed run neither replays step 1's draws nor depends on
    anything but its config."""
    digest = hashlib.sha256(f"{seed}:resume:{iteration}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
