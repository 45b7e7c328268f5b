"""``T5Layer``: one encoder (``cross = False``) or decoder layer of T5; pre-norm, residual adds.

Under sequence parallelism (``parallel.sequence_parallel``, tp > 1) the layer sees ``[s/tp, b, h]``
as gpt's does: norms on the local tokens (their gradients summed over TP), column linears gather
the sequence and row linears reduce-scatter it. Cross-attention's keys and values come from the
encoder output, itself ``[s_enc/tp, b, h]``: ``linear_kv`` gathers it like any other
sequence-parallel column linear input (Megatron gathers it the same way), so its backward
reduce-scatters the encoder output's gradient back to the shards.

Recompute: ``train.recompute = 'selective'`` checkpoints the core attentions with their bias as
an argument (``BiasedCoreAttention``); ``'full'`` is applied by ``T5Stack`` around each layer call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.attention import SelfAttention, SelfAttentionSubmodules
from mtl.models.gpt.mlp import MLPSubmodules
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs
from mtl.models.t5.attention import BiasedCoreAttention, CrossAttention
from mtl.models.t5.mlp import T5MLP
from mtl.parallel.random import get_rng_tracker


@dataclass(frozen=True)
class CrossAttentionSubmodules:
    linear_q: object
    linear_kv: object
    core_attention: object
    linear_proj: object


class T5Layer(nn.Module):
    def __init__(self, shape, backend: Backend, topology, *, layer_number: int, cross: bool,
                 sequence_parallel: bool = False, recompute_attention: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        norm_kwargs = sequence_parallel_norm_kwargs(sequence_parallel, topology)

        def norm():
            return backend.norm(shape.hidden_size, kind="rmsnorm", eps=shape.norm_eps, **norm_kwargs)

        attention = dict(hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                         head_dim=shape.head_dim, init_std=shape.init_std, attention_dropout=shape.dropout)
        core = ModuleSpec(BiasedCoreAttention, dict(recompute=recompute_attention))
        self.input_norm = norm()
        self.self_attention = build_module(
            ModuleSpec(SelfAttention, dict(attention, num_query_groups=shape.num_attention_heads, bias=False,
                                           qkv_bias=False, output_init_std=shape.init_std,
                                           sequence_parallel=sequence_parallel, recompute_core_attention=False),
                       SelfAttentionSubmodules(backend.column_linear, core, backend.row_linear)),
            layer_number=layer_number, topology=topology,
        )
        self.cross_attention = None
        if cross:
            self.pre_cross_attention_norm = norm()
            self.cross_attention = CrossAttention(
                **attention, layer_number=layer_number, topology=topology, sequence_parallel=sequence_parallel,
                submodules=CrossAttentionSubmodules(backend.column_linear, backend.column_linear, core, backend.row_linear),
            )
        self.pre_mlp_norm = norm()
        self.mlp = T5MLP(hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                         activation=shape.activation, init_std=shape.init_std, output_init_std=shape.init_std,
                         topology=topology, sequence_parallel=sequence_parallel,
                         submodules=MLPSubmodules(backend.column_linear, backend.row_linear))
        self.dropout = nn.Dropout(shape.dropout)

    def forward(self, hidden, self_bias, encoder_output=None, cross_bias=None, inference_context=None):
        """hidden [s(/tp), b, h]; biases [1 or b, heads/tp, s_q, s_kv] -> [s(/tp), b, h]; with an
        ``inference_context`` the self-attention's keys and values join the cache (gpt's)."""
        self.self_attention.core_attention.set_bias(self_bias)
        hidden = hidden + self._dropout(self.self_attention(self.input_norm(hidden), None, inference_context))
        if self.cross_attention is not None:
            self.cross_attention.core_attention.set_bias(cross_bias)
            hidden = hidden + self._dropout(self.cross_attention(self.pre_cross_attention_norm(hidden),
                                                                 encoder_output, inference_context))
        self.self_attention.core_attention.set_bias(None)
        if self.cross_attention is not None:
            self.cross_attention.core_attention.set_bias(None)
        return hidden + self._dropout(self.mlp(self.pre_mlp_norm(hidden)))

    def _dropout(self, hidden: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism each TP rank holds other tokens: their masks come from the TP stream."""
        return sequence_parallel_dropout(self.dropout, hidden, self.sequence_parallel)


def sequence_parallel_dropout(dropout: nn.Dropout, hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    if not (sequence_parallel and dropout.training and dropout.p > 0):
        return dropout(hidden)
    with get_rng_tracker().fork():
        return dropout(hidden)
