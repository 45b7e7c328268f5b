"""One encoder layer: gpt's self-attention and MLP (built from gpt's spec, with a
bidirectional, padding-masked core attention) and two norms, before or after the residual adds.

    pre  (Megatron's BERT):  h = h + attn(input_norm(h));  h = h + mlp(pre_mlp_norm(h))
    post (BERT, RoBERTa):    h = post_attention_norm(h + attn(h));  h = post_mlp_norm(h + mlp(h))

The norms are named for where they sit, so a checkpoint of one arrangement never loads into the
other by accident; the attention and MLP parameters are named as gpt's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.config import RunConfig
from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.bert.attention import PaddedCoreAttention
from mtl.models.gpt.layer_spec import layer_spec as gpt_layer_spec
from mtl.models.gpt.transformer_layer import TransformerLayerSubmodules, sequence_parallel_norm_kwargs

NORM_NAMES = {"pre": ("input_norm", "pre_mlp_norm"), "post": ("post_attention_norm", "post_mlp_norm")}


class EncoderLayer(nn.Module):
    def __init__(self, *, layer_number: int, hidden_dropout: float, sequence_parallel: bool, norm_position: str,
                 topology, submodules: TransformerLayerSubmodules):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based
        self.hidden_dropout = hidden_dropout
        self.norm_position = norm_position
        norm_kwargs = sequence_parallel_norm_kwargs(sequence_parallel, topology)
        attention_norm, mlp_norm = NORM_NAMES[norm_position]
        setattr(self, attention_norm, build_module(submodules.input_norm, **norm_kwargs))
        self.self_attention = build_module(submodules.self_attention, layer_number=layer_number, topology=topology)
        setattr(self, mlp_norm, build_module(submodules.pre_mlp_norm, **norm_kwargs))
        self.mlp = build_module(submodules.mlp, topology=topology)
        self.attention_norm, self.mlp_norm = getattr(self, attention_norm), getattr(self, mlp_norm)
        self.core_attention = self.self_attention.core_attention

    def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [s(/tp), b, h], padding_mask [b, s] bool (None: no padding) -> [s(/tp), b, h]."""
        self.core_attention.set_padding_mask(padding_mask)
        try:
            if self.norm_position == "pre":
                hidden = hidden + self._dropout(self.self_attention(self.attention_norm(hidden), None))
                return hidden + self._dropout(self.mlp(self.mlp_norm(hidden)))
            hidden = self.attention_norm(hidden + self._dropout(self.self_attention(hidden, None)))
            return self.mlp_norm(hidden + self._dropout(self.mlp(hidden)))
        finally:
            self.core_attention.set_padding_mask(None)  # hold no batch past the call

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        return F.dropout(branch, p=self.hidden_dropout, training=self.training)


def encoder_layer_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    """gpt's layer spec with the separate norm and linear leaves (a post-norm layer has no norm
    in front of a linear to fuse), its core attention made bidirectional and padding-masked."""
    unfused = dataclasses.replace(backend, norm_column_linear=None, norm_mlp=None)
    gpt_layer = gpt_layer_spec(config, unfused)
    attention = gpt_layer.submodules.self_attention
    core = ModuleSpec(PaddedCoreAttention, {"backend_attention": backend.core_attention,
                                            "recompute": config.train.recompute == "selective"})
    attention = dataclasses.replace(
        attention, params={**attention.params, "recompute_core_attention": False},  # PaddedCoreAttention's own
        submodules=dataclasses.replace(attention.submodules, core_attention=core),
    )
    m = config.model
    return ModuleSpec(
        EncoderLayer,
        {"hidden_dropout": m.hidden_dropout, "sequence_parallel": config.parallel.sequence_parallel,
         "norm_position": m.norm_position},
        dataclasses.replace(gpt_layer.submodules, self_attention=attention, moe_mlp=None),
    )
