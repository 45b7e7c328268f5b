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
        """[s(/tp), b, h] through every layer, in order."""
        if not len(self):
            return hidden
        replay = self._graphed and self.training and inference_context is None and torch.is_grad_enabled()
        # Each layer leaves its MLP's residual add to the next (TransformerLayer's ``pending``),
        # which does it in its input norm's kernel when compiled. The first layer gets zeros so
        # that every layer's call has the same signature: one compiled graph for them all (a
        # None, or a tensor that does not require grad where the others do, is a graph of its
        # own). The last pending add is the block's.
        pending = torch.zeros_like(hidden).requires_grad_(torch.is_grad_enabled())
        for key, layer in self.items():
            graphed = self._graphed.get(key) if replay else None
            if graphed is not None and graphed.matches(hidden):
                hidden, pending = graphed(hidden, pending, rotary)
            elif self.recompute_full and self.training:
                hidden, pending = checkpointed(layer, hidden, rotary, inference_context, pending)
            else:
                hidden, pending = layer(hidden, rotary, inference_context, pending)
        return hidden + pending
