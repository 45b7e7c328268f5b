"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2.

GELU (GPT-2 style): ``fc2(gelu(fc1(x)))`` with fc1 ``[ffn, h]``. SwiGLU (Llama style):
fc1 fuses gate and up projections, ``[2 * ffn, h]`` globally, and each TP rank holds
``[gate_local; up_local]`` (``stride = 2``, recorded as ``ParamLayout.tp_stride = 2``);
``fc2(silu(gate) * up)``. Squared ReLU (Nemotron-H): ``fc2(relu(fc1(x))²)``, fc1 ``[ffn, h]``.

``norm``: the layer's pre-MLP norm, given when fc1 is the backend's fused norm + column
linear (it applies the norm; the layer passes the un-normalised hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.initialization import tag_weights
from mtl.parallel.param_layout import param_layout, set_param_layout
from mtl.models.swiglu import swiglu


@dataclass(frozen=True)
class MLPSubmodules:
    linear_fc1: Any
    linear_fc2: Any


class MLP(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str,
        bias: bool,
        init_std: float,
        output_init_std: float,
        sequence_parallel: bool,
        topology,
        submodules: MLPSubmodules,
        norm: nn.Module | None = None,
    ):
        super().__init__()
        self.gated = activation == "swiglu"
        self.activation = activation
        fc1_width = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            hidden_size,
            fc1_width,
            bias=bias,
            init_std=init_std,
            topology=topology,
            sequence_parallel=sequence_parallel,
            stride=2 if self.gated else 1,
            **({"norm": norm} if norm is not None else {}),
        )
        tag_weights(self.linear_fc1, "normal")
        if self.gated:
            for param in self.linear_fc1.parameters():
                if param_layout(param).tp_split_dim is not None:  # not a backend's replicated state (FP8 amax history)
                    set_param_layout(param, tp_stride=2)
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            hidden_size,
            bias=bias,
            init_std=output_init_std,
            topology=topology,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
        )
        tag_weights(self.linear_fc2, "residual_output")  # writes into the residual stream: the scaled init

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h] (the sequence split is SP's, undone and redone by the linears)."""
        intermediate = self.linear_fc1(hidden)  # [s, b, fc1_width / tp]
        if self.gated:  # [gate | up], each [s, b, ffn / tp]; a backward that reads them once
            intermediate = swiglu(intermediate)
        elif self.activation == "relu2":  # squared ReLU (Nemotron-H)
            # relu * relu, not square(): autocast runs pow in fp32, and fc2 then gets an fp32 input
            # beside a bf16 gradient (the fused weight-gradient GEMM refuses the mix)
            relu = F.relu(intermediate)
            intermediate = relu * relu
        else:
            intermediate = F.gelu(intermediate)
        return self.linear_fc2(intermediate)
