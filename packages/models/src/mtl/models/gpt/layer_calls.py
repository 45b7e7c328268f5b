"""How a ``TransformerBlock``'s layers are called once something outside the model changes it.

The block's own forward is the plain loop ``hidden = layer(hidden, rotary, inference_context)``.
Three things change how a layer is called without touching the layer's or the block's code,
each applied by a function of its own file, in this order:

1. the residual deferral (``residual_deferral.py``, under ``train.compile``): each layer's call
   becomes a step that also takes and returns the MLP output not yet added;
2. full recompute (``recompute.py``, ``train.recompute = 'full'``): each call is checkpointed;
3. CUDA-graph replay (``cuda_graphs.py``, ``train.cuda_graphs``): each call replays its graphs.

``LayerCalls`` holds, per layer, the ``unit`` (the module ``train.compile`` compiles in place:
the layer, or its deferred step) and the ``call`` the loop makes (the unit, or a wrapper around
it that calls it: a checkpoint or a graph replay stays outside the compiled region). Installed
as the block's ``forward`` (an instance attribute, as ``torch.cuda.make_graphed_callables``
replaces a module's forward), so module tree and parameter names do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.models.gpt.inference_context import InferenceContext


class LayerCalls:
    """The block's forward with per-layer calls: ``(hidden, rotary, inference_context) -> hidden``."""

    def __init__(self, block: nn.ModuleDict, units: list[nn.Module] | None = None):
        self.layers = list(block.values())  # the block's layers, as their keys order them
        self.keys = list(block.keys())
        self.units = units if units is not None else list(self.layers)
        self.calls = list(self.units)

    def __call__(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        for call in self.calls:
            hidden = call(hidden, rotary, inference_context)
        return hidden


def installed_calls(block: nn.ModuleDict) -> LayerCalls | None:
    """The block's ``LayerCalls``, or None while it runs its own plain loop."""
    calls = block.__dict__.get("forward")
    return calls if isinstance(calls, LayerCalls) else None


def install_calls(block: nn.ModuleDict, calls: LayerCalls) -> LayerCalls:
    block.forward = calls
    return calls


def layer_calls(block: nn.ModuleDict) -> LayerCalls:
    """The block's ``LayerCalls``, installed over the plain loop (one call per layer, the layer) if none is."""
    return installed_calls(block) or install_calls(block, LayerCalls(block))


def compile_units(block: nn.ModuleDict) -> list[nn.Module]:
    """The modules of the block that ``train.compile`` compiles, one region each."""
    calls = installed_calls(block)
    return list(calls.units) if calls is not None else list(block.values())
