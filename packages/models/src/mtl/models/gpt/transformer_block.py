"""The stack of transformer layers one pipeline stage holds, keyed by GLOBAL layer number.

A ``ModuleDict`` so parameter names read ``layers.{i}.…`` with ``i`` the layer's index in
the whole model: a checkpoint written by one pipeline split loads into any other.

Its forward is the plain loop. What changes how the layers are called for speed or memory (the
residual deferral under ``train.compile``, full recompute, CUDA-graph replay) is applied from
outside, by replacing this forward with the per-layer calls of ``layer_calls.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.errors import ConfigError
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.inference_context import InferenceContext


class TransformerBlock(nn.ModuleDict):
    def __init__(self, spec: ModuleSpec, layer_range: tuple[int, int], num_layers: int, topology):
        start, end = layer_range
        if not 0 <= start <= end <= num_layers:
            raise ConfigError(
                f"layer_range = {layer_range} is not inside the model's {num_layers} layers "
                "(model.num_layers); pass (start, end) with 0 <= start <= end <= num_layers"
            )
        super().__init__({str(i): build_module(spec, layer_number=i, topology=topology) for i in range(start, end)})

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """[s(/tp), b, h] through every layer, in order."""
        for layer in self.values():
            hidden = layer(hidden, rotary, inference_context)
        return hidden
