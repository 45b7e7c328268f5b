"""One pre-norm transformer layer: input norm -> self-attention -> residual -> pre-MLP norm
-> MLP -> residual. Its parts come from a ``ModuleSpec`` (see ``layer_spec.py``); the MLP of
the layers listed in ``moe_layers`` is ``submodules.moe_mlp`` (a mixture of experts).

With a backend that fuses a norm into the linear after it (``fuse_input_norm``: into QKV;
``fuse_pre_mlp_norm``: into the MLP's fc1 or the whole MLP) the norm is still built here and
keeps its name, but the fused leaf applies it: the layer hands it over and skips its call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.gpt.inference_context import InferenceContext


@dataclass(frozen=True)
class TransformerLayerSubmodules:
    input_norm: Any
    self_attention: Any
    pre_mlp_norm: Any
    mlp: Any
    moe_mlp: Any = None  # the MLP of the layers in ``moe_layers`` (mtl.models.moe.MoELayer)


def sequence_parallel_norm_kwargs(sequence_parallel: bool, topology) -> dict:
    """Under sequence parallelism a norm sees ``[s/tp, b, h]`` with a replicated weight, so it
    needs the topology to sum its gradients over TP (the local backend's extra keywords).
    Passed only then, so that a backend following the bare ``norm`` contract still builds."""
    return {"topology": topology, "sequence_parallel": True} if sequence_parallel else {}


class TransformerLayer(nn.Module):
    """``hidden + attention_branch``, then ``+ mlp_branch``: two residual branches. The branches
    are methods of their own so that a transformation outside the layer can call them (the
    residual deferral under ``train.compile``, ``residual_deferral.py``); ``forward`` is the
    layer as it reads."""

    def __init__(
        self,
        *,
        layer_number: int,
        hidden_dropout: float,
        sequence_parallel: bool,
        topology,
        submodules: TransformerLayerSubmodules,
        fuse_input_norm: bool = False,
        fuse_pre_mlp_norm: bool = False,
        moe_layers: tuple[int, ...] = (),
    ):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based
        self.hidden_dropout = hidden_dropout
        norm_kwargs = sequence_parallel_norm_kwargs(sequence_parallel, topology)
        self.input_norm = build_module(submodules.input_norm, **norm_kwargs)
        self.fuse_input_norm = fuse_input_norm
        self.fuse_pre_mlp_norm = fuse_pre_mlp_norm
        self.self_attention = build_module(
            submodules.self_attention, layer_number=layer_number, topology=topology,
            **({"input_norm": self.input_norm} if fuse_input_norm else {}),
        )
        self.pre_mlp_norm = build_module(submodules.pre_mlp_norm, **norm_kwargs)
        mlp = submodules.moe_mlp if layer_number in moe_layers else submodules.mlp
        self.mlp = build_module(mlp, topology=topology, **({"norm": self.pre_mlp_norm} if fuse_pre_mlp_norm else {}))

    def attention_branch(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """dropout(self_attention(input_norm(hidden))): [s(/tp), b, h] -> [s(/tp), b, h]."""
        attention_in = hidden if self.fuse_input_norm else self.input_norm(hidden)
        attention_out = self.self_attention(attention_in, rotary, inference_context)
        return F.dropout(attention_out, p=self.hidden_dropout, training=self.training)

    def mlp_branch(self, hidden: torch.Tensor) -> torch.Tensor:
        """dropout(mlp(pre_mlp_norm(hidden))): [s(/tp), b, h] -> [s(/tp), b, h]."""
        mlp_out = self.mlp(hidden if self.fuse_pre_mlp_norm else self.pre_mlp_norm(hidden))
        return F.dropout(mlp_out, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """[s(/tp), b, h] -> [s(/tp), b, h]."""
        hidden = hidden + self.attention_branch(hidden, rotary, inference_context)
        return hidden + self.mlp_branch(hidden)
