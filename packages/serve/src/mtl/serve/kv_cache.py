"""The paged KV cache: a pool of fixed-size blocks and the block table of each sequence.

Keys and values of every layer live in one tensor per layer, ``[num_blocks * block_size,
groups, head_dim]``: token ``i`` of a sequence sits in slot ``table[i // block_size] *
block_size + i % block_size``. A sequence holds only the blocks its tokens fill, so memory is
not reserved per request up to the context length, and freeing a request returns its blocks
to the pool at once.

Admission reserves blocks against the pool; they are allocated only as tokens arrive (the
``in use`` count is what holds tokens). A request with ``max_tokens`` reserves its worst case
(prompt + max_tokens), so it never runs out of blocks and is never preempted. A request
without one (a chat that may run to the end of the context, as in vLLM) reserves what it
holds and ``extend``s its reservation a block at a time from the unreserved blocks; the
scheduler preempts such requests when none is left (``scheduler.py``)."""

from __future__ import annotations

import math
import re
from collections import deque

import torch

from mtl.core.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_memory(text: str) -> tuple[str, float]:
    """``--kv-memory``: ("fraction", f) for a number in (0, 1] (of the free GPU memory after the
    model is loaded), ("bytes", n) for a size such as ``64MiB`` or ``2GB``."""
    try:
        value = float(text)
    except ValueError:
        match = _SIZE.match(text)
        if match is None:
            raise ConfigError(f"--kv-memory {text!r} is neither a fraction of free GPU memory (0.9) nor a size "
                              "(256MiB, 2GB)") from None
        return "bytes", float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if 0 < value <= 1:
        return "fraction", value
    if value > 1:
        return "bytes", value
    raise ConfigError(f"--kv-memory {text!r} must be positive")


def kv_budget_bytes(kv_memory: str, device: torch.device) -> int:
    kind, value = parse_kv_memory(kv_memory)
    if kind == "bytes":
        return int(value)
    if device.type != "cuda":
        raise ConfigError(f"--kv-memory {kv_memory} is a fraction of free GPU memory, but the model runs on "
                          f"{device}; give a size instead, e.g. --kv-memory 256MiB")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * value)


class BlockManager:
    """Which blocks are free and which belong to each sequence, plus the reservations that
    guarantee every admitted sequence can grow to its worst case."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # sequence -> blocks it may come to hold
        self._reserved_total = 0

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def unreserved(self) -> int:
        return self.num_blocks - self._reserved_total

    def can_reserve(self, max_tokens: int) -> bool:
        return self.blocks_for(max_tokens) <= self.unreserved

    def reserve(self, seq: int, max_tokens: int) -> None:
        self._reserved[seq] = self.blocks_for(max_tokens)
        self._reserved_total += self._reserved[seq]
        self.tables[seq] = []

    def extend(self, seq: int, num_tokens: int) -> bool:
        """Raise the sequence's reservation to ``num_tokens`` tokens if enough blocks are
        unreserved; whether it now covers them."""
        extra = self.blocks_for(num_tokens) - self._reserved[seq]
        if extra > self.unreserved:
            return False
        if extra > 0:
            self._reserved[seq] += extra
            self._reserved_total += extra
        return True

    def grow(self, seq: int, num_tokens: int) -> list[int]:
        """Enough blocks for the sequence's first ``num_tokens`` tokens; its table."""
        table = self.tables[seq]
        needed = self.blocks_for(num_tokens)
        if needed > self._reserved[seq]:
            raise RuntimeError(f"sequence {seq} grew past its reservation ({needed} > {self._reserved[seq]} blocks)")
        while len(table) < needed:
            table.append(self._free.popleft())
        return table

    def free(self, seq: int) -> None:
        self._free.extend(self.tables.pop(seq, []))
        self._reserved_total -= self._reserved.pop(seq, 0)

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        """The cache slots of the sequence's tokens ``start .. end - 1``."""
        table, size = self.tables[seq], self.block_size
        return [table[i // size] * size + i % size for i in range(start, end)]


class KVPool:
    """Keys and values of every layer of this rank, ``[slots, local groups, head_dim]`` each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, groups: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks * block_size, groups, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, groups: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * groups * head_dim * torch.empty((), dtype=dtype).element_size()
