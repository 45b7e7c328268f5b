"""Named random-number streams, so dropout inside tensor-parallel regions is right.

Dropout on a tensor that is *split* over TP ranks (attention probabilities of the local
heads, an MLP's local hidden slice) must draw different numbers on each TP rank, yet the same
numbers on every data-parallel replica. Dropout on *replicated* activations (outside TP
regions) must draw the same numbers on every TP rank. Megatron solves this with two streams,
and so do we:

- the default torch generator, seeded ``seed + 100 * pp_rank`` (same on all TP and DP ranks
  of a stage);
- the ``"model-parallel"`` stream, seeded ``seed + 100 * pp_rank + 2718 + tp_rank``, entered
  with ``with get_rng_tracker().fork(): ...`` around dropout on split activations.

The tracker swaps the device's global generator state in and out (``F.dropout`` takes no
generator argument), for CPU or the current CUDA device.

    seed_everything(1234, topology)
    with get_rng_tracker().fork():
        probs = torch.nn.functional.dropout(probs, p=0.1)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mtl.core.errors import ParallelError

MODEL_PARALLEL_STREAM = "model-parallel"
TP_SEED_OFFSET = 2718  # Megatron's offset, kept so seeds mean the same thing in both
PP_SEED_STRIDE = 100


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states for one device; ``fork(name)`` runs a block on that stream."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def names(self) -> list[str]:
        return sorted(self._states)

    def is_initialized(self, name: str = MODEL_PARALLEL_STREAM) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``, without disturbing the current stream."""
        if name in self._states:
            raise ParallelError(f"RNG stream '{name}' already exists; call reset() before re-seeding it")
        if seed in self._seeds.values():
            other = next(n for n, s in self._seeds.items() if s == seed)
            raise ParallelError(f"RNG stream '{name}' would reuse seed {seed} of stream '{other}'; pick another seed")
        saved = _get_state(self.device)
        try:
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = _get_state(self.device)
        finally:
            _set_state(saved, self.device)
        self._seeds[name] = seed

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and activation recomputation)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM) -> Iterator[None]:
        """Run the block on stream ``name``; the stream advances, the default one does not."""
        if name not in self._states:
            raise ParallelError(
                f"RNG stream '{name}' is not initialised (have: {self.names() or 'none'}); "
                "call mtl.parallel.random.seed_everything(seed, topology) first"
            )
        saved = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(saved, self.device)


_TRACKER = RNGStatesTracker("cpu")


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (re-created for the right device by ``seed_everything``)."""
    return _TRACKER


def seed_everything(seed: int, topology=None, device: torch.device | str | None = None) -> RNGStatesTracker:
    """Seed Python-visible torch generators the Megatron way and (re)build the tracker.

    ``topology`` is an ``mtl.parallel.topology.Topology`` (None = one process). ``device``
    defaults to the current CUDA device when CUDA is available, else the CPU."""
    global _TRACKER
    if seed < 0:
        raise ParallelError(f"seed must be non-negative, got {seed}")
    tp_rank = topology.tp_rank if topology is not None else 0
    pp_rank = topology.pp_rank if topology is not None else 0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    default_seed = seed + PP_SEED_STRIDE * pp_rank
    torch.manual_seed(default_seed)  # seeds CPU and every CUDA device
    _TRACKER = RNGStatesTracker(device)
    _TRACKER.add(MODEL_PARALLEL_STREAM, default_seed + TP_SEED_OFFSET + tp_rank)
    return _TRACKER
