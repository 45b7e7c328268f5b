"""Activation recomputation that also replays the tensor-parallel RNG stream.

``torch.utils.checkpoint`` restores the default generator before recomputing, so dropout on
replicated activations draws the same mask twice. Dropout on TP-split activations draws from
mtl.parallel's "model-parallel" stream, which lives outside torch; without restoring it the
recomputed forward would use a different mask than the original one and the gradients would
be wrong. This wrapper snapshots the tracker's streams and replays them for the recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mtl.parallel.random import get_rng_tracker


def checkpointed(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` without keeping its activations; recomputed in backward.

    Inside a ``torch.compile`` region (``train.compile``) this is a plain non-reentrant
    checkpoint: dynamo cannot trace a custom ``context_fn``, and the compiled graph's
    partitioner saves what random ops draw instead of drawing again on recompute."""
    if torch.compiler.is_compiling():
        return checkpoint(function, *args, use_reentrant=False)
    tracker = get_rng_tracker()
    snapshot: dict = {}

    @contextlib.contextmanager
    def forward_context():
        snapshot.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute_context():
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            yield
        finally:
            tracker.set_states(current)

    return checkpoint(
        function, *args, use_reentrant=False, context_fn=lambda: (forward_context(), recompute_context())
    )
