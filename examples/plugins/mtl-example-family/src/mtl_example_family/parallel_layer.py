"""The GPT-J block: one input norm feeds attention and the MLP side by side, and both outputs
are added to the residual stream, ``x + attn(norm(x)) + mlp(norm(x))`` (no pre-MLP norm).

Everything but the block's wiring is mtl's: gpt's self-attention and MLP specs with the
selected backend's leaves, so tensor, sequence and pipeline parallelism, initialisation
(the leaves tag their parameters' ``init_kind``) and checkpoints work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.layer_spec import layer_spec as gpt_layer_spec
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs


@dataclass(frozen=True)
class ParallelLayerSubmodules:
    input_norm: Any
    self_attention: Any
    mlp: Any


class ParallelTransformerLayer(nn.Module):
    def __init__(self, *, layer_number: int, hidden_dropout: float, sequence_parallel: bool, topology,
                 submodules: ParallelLayerSubmodules):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based (the KV cache is kept per layer)
        self.hidden_dropout = hidden_dropout
        self.input_norm = build_module(submodules.input_norm, **sequence_parallel_norm_kwargs(sequence_parallel, topology))
        self.self_attention = build_module(submodules.self_attention, layer_number=layer_number, topology=topology)
        self.mlp = build_module(submodules.mlp, topology=topology)

    def forward(self, hidden: torch.Tensor, rotary=None, inference_context=None) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]; the same call as gpt's layer, so GPTModel's stack runs it."""
        normed = self.input_norm(hidden)
        attention_out = self.self_attention(normed, rotary, inference_context)
        mlp_out = self.mlp(normed)
        return hidden + self._dropout(attention_out) + self._dropout(mlp_out)

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        return F.dropout(branch, p=self.hidden_dropout, training=self.training)


def parallel_layer_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    """gpt's attention and MLP specs, wired in parallel. A backend's fused norm + linear
    applies the norm inside one consumer, but here one norm feeds two, so the leaves are
    asked for unfused (the separate norm and linears every backend has). Its MLP is dense:
    a config with experts is refused rather than built without them."""
    if config.model.num_experts:
        raise ConfigError(
            f"model.num_experts = {config.model.num_experts}: the parallel_gpt family's layers have dense MLPs only; "
            "set model.num_experts = 0 or use model.family = 'gpt'"
        )
    gpt = gpt_layer_spec(config, replace(backend, norm_column_linear=None, norm_mlp=None)).submodules
    return ModuleSpec(
        ParallelTransformerLayer,
        {"hidden_dropout": config.model.hidden_dropout, "sequence_parallel": config.parallel.sequence_parallel},
        ParallelLayerSubmodules(input_norm=gpt.input_norm, self_attention=gpt.self_attention, mlp=gpt.mlp),
    )
