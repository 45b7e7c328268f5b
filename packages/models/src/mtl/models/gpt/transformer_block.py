"""The stack of transformer layers one pipeline stage holds, keyed by GLOBAL layer number.

A ``ModuleDict`` so parameter names read ``layers.{i}.…`` with ``i`` the layer's index in
the whole model: a checkpoint written by one pipeline split loads into any other.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.recompute import checkpointed


def defers_residual_add(layer: nn.Module) -> bool:
    """Whether ``layer`` takes the previous layer's MLP output unadded (``TransformerBlock.forward``)."""
    return getattr(layer, "defers_residual_add", False)


class TransformerBlock(nn.ModuleDict):
    def __init__(self, spec: ModuleSpec, layer_range: tuple[int, int], num_layers: int, topology, recompute_full: bool):
        start, end = layer_range
        if not 0 <= start <= end <= num_layers:
            raise ConfigError(
                f"layer_range = {layer_range} is not inside the model's {num_layers} layers "
                "(model.num_layers); pass (start, end) with 0 <= start <= end <= num_layers"
            )
        super().__init__({str(i): build_module(spec, layer_number=i, topology=topology) for i in range(start, end)})
        self.recompute_full = recompute_full
        self._graphed: dict = {}  # key -> cuda_graphs.GraphedLayer (train.cuda_graphs); not modules

    def use_graphed_layers(self, graphed: dict) -> None:
        """Replay these captured layers in training forwards (``cuda_graphs.capture_layer_graphs``)."""
        self.__dict__["_graphed"] = graphed

    @property
    def graphed_layers(self) -> dict:
        return self._graphed

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """[s(/tp), b, h] through every layer, in order.

        A layer class with ``defers_residual_add = True`` (``TransformerLayer``) takes the
        previous layer's MLP output unadded (``pending``) and returns its own unadded, so that
        under ``train.compile`` each residual add runs inside the next layer's input-norm kernel.
        The first such layer gets zeros, so that every call has one signature and one compiled
        graph serves them all (a None, or a tensor that does not require grad where the others
        do, is a graph of its own). A layer of the plain contract, ``(hidden, rotary,
        inference_context) -> hidden`` (a plugin family's), gets the sum; the block adds the last."""
        replay = self._graphed and self.training and inference_context is None and torch.is_grad_enabled()
        pending = None
        for key, layer in self.items():
            defers = defers_residual_add(layer)
            if defers and pending is None:
                pending = torch.zeros_like(hidden).requires_grad_(torch.is_grad_enabled())
            elif not defers and pending is not None:
                hidden, pending = hidden + pending, None
            extra = (pending,) if defers else ()
            graphed = self._graphed.get(key) if replay else None
            if graphed is not None and graphed.matches(hidden):
                out = graphed(hidden, rotary, *extra)
            elif self.recompute_full and self.training:
                out = checkpointed(layer, hidden, rotary, inference_context, *extra)
            else:
                out = layer(hidden, rotary, inference_context, *extra)
            hidden, pending = out if defers else (out, None)
        return hidden if pending is None else hidden + pending
