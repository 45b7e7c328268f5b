"""One layer of a hybrid stack: ``hidden + dropout(body(norm(hidden)))``, the body chosen by the
layer's symbol in ``model.hybrid_pattern`` (Megatron's hybrid layers each hold one mixer):

- ``M``: ``norm`` + ``mixer`` (a ``Mamba2Mixer``);
- ``*``: ``input_norm`` + ``self_attention`` (gpt's ``SelfAttention``, RoPE as configured);
- ``-`` / ``E``: ``pre_mlp_norm`` + ``mlp`` (gpt's ``MLP`` / ``MoELayer``).

Attention and MLP keep gpt's parameter names, so those layers read like gpt's in checkpoints and
conversions. Where the backend fuses a norm into the linear after it, the norm is still built
here and handed to the fused leaf, as in gpt's ``TransformerLayer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs

# symbol -> (norm's name, body's name)
PARTS = {"M": ("norm", "mixer"), "*": ("input_norm", "self_attention"), "-": ("pre_mlp_norm", "mlp"),
         "E": ("pre_mlp_norm", "mlp")}


@dataclass(frozen=True)
class HybridLayerSubmodules:
    norm: Any
    mamba: Any
    attention: Any
    mlp: Any
    moe: Any = None  # None: the pattern has no "E"


class HybridLayer(nn.Module):
    def __init__(
        self,
        *,
        layer_number: int,
        symbols: str,
        hidden_dropout: float,
        sequence_parallel: bool,
        topology,
        submodules: HybridLayerSubmodules,
        fuse_input_norm: bool = False,
        fuse_pre_mlp_norm: bool = False,
    ):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based
        self.symbol = symbols[layer_number]
        self.hidden_dropout = hidden_dropout
        norm_name, body_name = PARTS[self.symbol]
        norm = build_module(submodules.norm, **sequence_parallel_norm_kwargs(sequence_parallel, topology))
        setattr(self, norm_name, norm)
        self.fused_norm = (fuse_input_norm if self.symbol == "*" else fuse_pre_mlp_norm) and self.symbol != "M"
        if self.symbol == "M":
            body = build_module(submodules.mamba, layer_number=layer_number, topology=topology)
        elif self.symbol == "*":
            body = build_module(submodules.attention, layer_number=layer_number, topology=topology,
                                **({"input_norm": norm} if self.fused_norm else {}))
        else:
            body = build_module(submodules.moe if self.symbol == "E" else submodules.mlp, topology=topology,
                                **({"norm": norm} if self.fused_norm else {}))
        setattr(self, body_name, body)
        self.part_names = (norm_name, body_name)

    def forward(self, hidden: torch.Tensor, rotary=None, inference_context=None) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]."""
        norm, body = (getattr(self, name) for name in self.part_names)
        body_in = hidden if self.fused_norm else norm(hidden)
        if self.symbol == "M":
            out = body(body_in, inference_context)
        elif self.symbol == "*":
            out = body(body_in, rotary, inference_context)
        else:
            out = body(body_in)
        return hidden + F.dropout(out, p=self.hidden_dropout, training=self.training)
