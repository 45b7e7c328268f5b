"""T5 attention: unscaled dot products (T5 folds 1/sqrt(d) into its initialisation) plus an
additive bias (relative positions, the causal and padding masks), over this TP rank's heads.

Self-attention reuses gpt's ``SelfAttention`` (fused QKV, output projection) with
``BiasedCoreAttention`` as its core attention; the layer hands the bias over right before the
call (``set_bias``), as the bert family hands its padding mask. Cross-attention has its own
projections: queries from the decoder, keys and values from the encoder output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.gpt.recompute import checkpointed
from mtl.models.initialization import tag_weights


class BiasedCoreAttention(nn.Module):
    def __init__(self, *, num_heads: int, num_query_groups: int, head_dim: int, dropout: float, topology,
                 causal: bool = False, recompute: bool = False):
        super().__init__()
        del causal, topology  # the causal mask is part of the bias the layer sets
        self.num_heads, self.num_query_groups, self.dropout = num_heads, num_query_groups, dropout
        # train.recompute = 'selective', here rather than in gpt's SelfAttention: the bias must be
        # an argument of the recomputed call (the attribute is cleared by the time backward runs)
        self.recompute = recompute
        self.bias: torch.Tensor | None = None  # [1 or b, heads/tp, s_q, s_kv] fp32

    def set_bias(self, bias: torch.Tensor | None) -> None:
        self.bias = bias

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, s_q, heads, d], k/v [b, s_kv, groups, d] -> [b, s_q, heads, d]."""
        if self.recompute and self.training:
            return checkpointed(self._attend, q, k, v, self.bias)
        return self._attend(q, k, v, self.bias)

    def _attend(self, q, k, v, bias: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.num_heads != self.num_query_groups:
            repeat = self.num_heads // self.num_query_groups
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        bias = bias.to(q.dtype) if bias is not None else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.transpose(1, 2)


class CrossAttention(nn.Module):
    """decoder hidden [s_dec, b, h] and encoder output [s_enc, b, h] -> [s_dec, b, h]; the rows
    of ``linear_kv`` are ``[k | v]`` per head (group-major, as gpt's fused QKV), so a column split
    gives each TP rank whole heads."""

    def __init__(self, *, layer_number: int, hidden_size: int, num_attention_heads: int, head_dim: int,
                 init_std: float, attention_dropout: float, topology, submodules, sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_number
        tp = topology.tp if topology is not None else 1
        self.local_heads, self.head_dim = num_attention_heads // tp, head_dim
        width = num_attention_heads * head_dim
        # under sequence parallelism both inputs are sequence shards: each column linear gathers its own
        common = dict(bias=False, init_std=init_std, topology=topology, sequence_parallel=sequence_parallel)
        self.linear_q = build_module(submodules.linear_q, hidden_size, width, **common)
        self.linear_kv = build_module(submodules.linear_kv, hidden_size, 2 * width, **common)
        self.core_attention = build_module(submodules.core_attention, num_heads=self.local_heads,
                                           num_query_groups=self.local_heads, head_dim=head_dim,
                                           dropout=attention_dropout, topology=topology)
        self.linear_proj = build_module(submodules.linear_proj, width, hidden_size, **common, input_is_parallel=True)
        for linear in (self.linear_q, self.linear_kv):
            tag_weights(linear, "normal")
        tag_weights(self.linear_proj, "residual_output")

    def forward(self, hidden: torch.Tensor, encoder_output: torch.Tensor, inference_context=None) -> torch.Tensor:
        """``inference_context`` (an ``EncoderDecoderContext``, generation): the encoder's keys and
        values are projected at the first step and read from it at the others."""
        q = self.linear_q(hidden)  # [s, b, heads/tp * d]: the whole decoder sequence under SP too
        s, b = q.shape[:2]
        q = q.view(s, b, self.local_heads, self.head_dim)
        cached = inference_context.cross_kv.get(self.layer_number) if inference_context is not None else None
        if cached is None:
            kv = self.linear_kv(encoder_output)  # [s_enc, b, 2 * heads/tp * d], gathered under SP
            kv = kv.view(kv.shape[0], b, self.local_heads, 2, self.head_dim)
            cached = (kv[:, :, :, 0].transpose(0, 1), kv[:, :, :, 1].transpose(0, 1))  # [b, s_enc, heads, d]
            if inference_context is not None:
                inference_context.cross_kv[self.layer_number] = cached
        context = self.core_attention(q.transpose(0, 1), *cached)  # [b, s, heads, d]
        return self.linear_proj(context.transpose(0, 1).reshape(s, b, self.local_heads * self.head_dim))
