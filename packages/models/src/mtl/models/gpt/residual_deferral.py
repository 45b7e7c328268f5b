"""The residual deferral: each layer's last residual add is left to the next layer, applied
from outside the layer (``apply_residual_deferral``) where ``train.compile`` is on.

Why: under ``train.compile`` each layer is its own compiled region (one graph shared by all).
A layer that ends with ``hidden + mlp_out`` pays a kernel of its own for that add, which reads
both tensors and writes the sum; handed over unadded, the add runs inside the next layer's
input-norm kernel, which reads the residual stream anyway. That saved 0.9% of the reference
model's step time on an H100 (benchmarks/log). Eager, the numbers are the same bit for
bit: the same adds in the same order.

Each layer's call becomes a ``DeferredResidualStep``:
``(hidden, pending) -> (hidden + pending + attention_branch, mlp_branch)``. The first step gets
zeros rather than nothing, so that every step has one signature and one compiled graph serves
them all (a None, or a tensor that does not require grad where the others do, would be a graph
of its own); the block adds the last step's MLP output at the end.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import MtlError
from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.layer_calls import LayerCalls, install_calls, installed_calls


def supports_residual_deferral(layer: nn.Module) -> bool:
    """Whether ``layer`` exposes its two residual branches (``TransformerLayer``'s
    ``attention_branch`` and ``mlp_branch``); a layer with only the plain forward does not."""
    return callable(getattr(layer, "attention_branch", None)) and callable(getattr(layer, "mlp_branch", None))


class DeferredResidualStep(nn.Module):
    """One layer's call with its last residual add left to the next step. Holds the layer as
    its child (its parameters are the step's), and is not itself a child of the model, so
    parameter names stay ``layers.{i}.…``."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(
        self,
        hidden: torch.Tensor,
        pending: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, pending [s(/tp), b, h] -> (hidden, mlp_out), both [s(/tp), b, h]."""
        hidden = hidden + pending
        hidden = hidden + self.layer.attention_branch(hidden, rotary, inference_context)
        return hidden, self.layer.mlp_branch(hidden)


class DeferredResidualCalls(LayerCalls):
    """The block's forward over the layers' deferred steps (or wrappers of them, see ``layer_calls``)."""

    def __call__(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        pending = torch.zeros_like(hidden).requires_grad_(torch.is_grad_enabled())
        for call in self.calls:
            hidden, pending = call(hidden, pending, rotary, inference_context)
        return hidden + pending


def apply_residual_deferral(block: nn.ModuleDict) -> bool:
    """Run ``block``'s layers as deferred steps; False (and nothing changed) unless every layer
    supports it (a plugin family's layer of the plain contract keeps the plain loop). Apply it
    before anything else that changes the layers' calls (recompute, CUDA graphs)."""
    if installed_calls(block) is not None:
        raise MtlError(
            "apply_residual_deferral: the block's layer calls were already changed (recompute or CUDA "
            "graphs); apply the residual deferral first"
        )
    layers = list(block.values())
    if not layers or not all(supports_residual_deferral(layer) for layer in layers):
        return False
    install_calls(block, DeferredResidualCalls(block, [DeferredResidualStep(layer) for layer in layers]))
    return True


def is_deferred(block: nn.ModuleDict) -> bool:
    """Whether ``block``'s layer calls take and return the pending MLP output."""
    return isinstance(installed_calls(block), DeferredResidualCalls)
