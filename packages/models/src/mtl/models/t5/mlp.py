"""T5's feed-forward block: ``wo(relu(wi(x)))`` (T5 1.0) or ``wo(gelu_tanh(wi_0(x)) * wi_1(x))``
(T5 1.1, Flan-T5: gated GELU with the tanh approximation, HF's ``gelu_new``), no biases. The
gated form fuses ``[wi_0 | wi_1]`` into one column-parallel linear laid out as gpt's SwiGLU fc1
(each TP rank ``[gate_local; up_local]``, ``tp_stride = 2``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.initialization import tag_weights
from mtl.parallel.param_layout import set_param_layout

ACTIVATIONS = ("relu", "gated-gelu")


class T5MLP(nn.Module):
    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, activation: str, init_std: float,
                 output_init_std: float, topology, submodules, sequence_parallel: bool = False):
        super().__init__()
        self.gated = activation == "gated-gelu"
        self.linear_fc1 = build_module(submodules.linear_fc1, hidden_size, (2 if self.gated else 1) * ffn_hidden_size,
                                       bias=False, init_std=init_std, topology=topology,
                                       sequence_parallel=sequence_parallel, stride=2 if self.gated else 1)
        tag_weights(self.linear_fc1, "normal")
        if self.gated:
            set_param_layout(self.linear_fc1.weight, tp_stride=2)
        self.linear_fc2 = build_module(submodules.linear_fc2, ffn_hidden_size, hidden_size, bias=False,
                                       init_std=output_init_std, topology=topology, input_is_parallel=True,
                                       sequence_parallel=sequence_parallel)
        tag_weights(self.linear_fc2, "residual_output")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        intermediate = self.linear_fc1(hidden)  # [s, b, (2 *) ffn / tp]
        if self.gated:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.gelu(gate, approximate="tanh") * up
        else:
            intermediate = F.relu(intermediate)
        return self.linear_fc2(intermediate)
