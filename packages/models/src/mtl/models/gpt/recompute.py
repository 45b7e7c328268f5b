"""Activation recomputation that also replays the tensor-parallel RNG stream, and
``train.recompute = 'full'`` applied to a block's layers from outside (``apply_full_recompute``).

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
from torch import nn
from torch.utils.checkpoint import checkpoint

from mtl.models.gpt.layer_calls import layer_calls
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


class Recomputed:
    """A layer's call that keeps no activations in training (recomputed in backward); the
    checkpoint wraps the call, so a compiled layer is checkpointed from outside its region."""

    def __init__(self, call: Callable[..., Any], layer: nn.Module):
        self.call = call
        self.layer = layer  # whose ``training`` says whether to recompute

    def __call__(self, *args: Any) -> Any:
        if self.layer.training:
            return checkpointed(self.call, *args)
        return self.call(*args)


def apply_full_recompute(block: nn.ModuleDict) -> None:
    """``train.recompute = 'full'``: every layer of ``block`` recomputed in backward (``layer_calls.py``)."""
    calls = layer_calls(block)
    calls.calls = [Recomputed(call, layer) for call, layer in zip(calls.calls, calls.layers)]
