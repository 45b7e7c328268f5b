"""Self-attention: fused QKV, optional QK-norm, RoPE, the backend's core attention, output projection.

``bias`` is the output projection's bias; ``qkv_bias`` the fused QKV linear's (true whenever
``bias`` is, and alone for Qwen2-style models).

The fused QKV weight is ``[groups * (heads_per_group + 2) * d, h]`` with rows ordered
group-major: ``[g0: its q heads, k, v][g1: ...]``. A column-parallel split of its rows is
then a split over query groups, so each TP rank holds whole groups (their q heads with the
k/v head they share) and the global tensor does not depend on TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mtl.core.spec import build_module
from mtl.models.gpt.inference_context import InferenceContext
from mtl.models.gpt.recompute import checkpointed
from mtl.models.gpt.rope import apply_rotary
from mtl.models.gpt.rope_qkv import rotary_qkv
from mtl.models.initialization import tag_weights


@dataclass(frozen=True)
class SelfAttentionSubmodules:
    linear_qkv: Any
    core_attention: Any
    linear_proj: Any
    q_norm: Any = None  # None: no QK-norm
    k_norm: Any = None


class SelfAttention(nn.Module):
    def __init__(
        self,
        *,
        layer_number: int,
        hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int,
        head_dim: int,
        bias: bool,
        qkv_bias: bool,
        init_std: float,
        output_init_std: float,
        attention_dropout: float,
        sequence_parallel: bool,
        recompute_core_attention: bool,
        topology,
        submodules: SelfAttentionSubmodules,
        input_norm: nn.Module | None = None,
    ):
        super().__init__()
        tp = topology.tp
        self.layer_number = layer_number
        self.head_dim = head_dim
        self.heads_per_group = num_attention_heads // num_query_groups
        self.local_groups = num_query_groups // tp
        self.local_heads = num_attention_heads // tp
        self.recompute_core_attention = recompute_core_attention
        qkv_width = num_query_groups * (self.heads_per_group + 2) * head_dim
        # input_norm: the layer's norm, applied by a fused norm + column linear (the layer
        # then passes the un-normalised hidden states)
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            hidden_size,
            qkv_width,
            bias=qkv_bias,
            init_std=init_std,
            topology=topology,
            sequence_parallel=sequence_parallel,
            **({"norm": input_norm} if input_norm is not None else {}),
        )
        tag_weights(self.linear_qkv, "normal")
        # QK-norm weights are shared by all heads, but each TP rank normalises only its own
        # heads: like a norm under sequence parallelism, their gradients are summed over TP.
        qk_norm_kwargs = {"topology": topology, "sequence_parallel": True} if tp > 1 else {}
        self.q_norm = build_module(submodules.q_norm, **qk_norm_kwargs) if submodules.q_norm else None
        self.k_norm = build_module(submodules.k_norm, **qk_norm_kwargs) if submodules.k_norm else None
        self.core_attention = build_module(
            submodules.core_attention,
            num_heads=self.local_heads,
            num_query_groups=self.local_groups,
            head_dim=head_dim,
            causal=True,
            dropout=attention_dropout,
            topology=topology,
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            num_attention_heads * head_dim,
            hidden_size,
            bias=bias,
            init_std=output_init_std,
            topology=topology,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
        )
        tag_weights(self.linear_proj, "residual_output")  # writes into the residual stream: the scaled init

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        inference_context: InferenceContext | None = None,
    ) -> torch.Tensor:
        """hidden [s(/tp), b, h]; rotary: (cos, sin) [b, s, 1, d] or None -> [s(/tp), b, h]."""
        qkv = self.linear_qkv(hidden)  # [s, b, local_groups * (heads_per_group + 2) * d]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        # One rotation (rope.apply_rotary) on both paths. Without QK-norm it runs inside
        # rotary_qkv, whose backward writes qkv's gradient in one kernel (4.7 ms of an H100
        # step, rope_qkv.py); with QK-norm a norm sits between the split and the rotation, so
        # the rotation's gradient cannot go straight into qkv's and autograd's is kept.
        if rotary is not None and self.q_norm is None:
            query, key, value = rotary_qkv(qkv, *rotary)
        else:
            query = qkv[:, :, :, : self.heads_per_group].reshape(s, b, self.local_heads, self.head_dim)
            key = qkv[:, :, :, self.heads_per_group]  # [s, b, local_groups, d]
            value = qkv[:, :, :, self.heads_per_group + 1]
            if self.q_norm is not None:
                query, key = self.q_norm(query), self.k_norm(key)
            # sequence-first -> batch-first, the core attention's layout: [b, s, heads, d]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            if rotary is not None:  # QK-norm: rotate the normalised query and key
                cos, sin = rotary
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if getattr(inference_context, "attend", None) is not None:
            # a paged KV cache (mtl.serve) packs many sequences into one row: it stores the keys
            # and values in its blocks and attends over each sequence's own tokens itself
            context = inference_context.attend(self.layer_number, query, key, value)
        elif inference_context is not None:
            # [b, s, groups, d] -> all cached tokens [b, offset + s, groups, d]; the backend's
            # attention aligns the causal mask to the end when s_q < s_kv
            key, value = inference_context.append(self.layer_number, key, value)
            context = self.core_attention(query, key, value)
        elif self.recompute_core_attention and self.training:
            context = checkpointed(self.core_attention, query, key, value)
        else:
            context = self.core_attention(query, key, value)  # [b, s, local_heads, d]
        context = context.transpose(0, 1).reshape(s, b, self.local_heads * self.head_dim)
        return self.linear_proj(context)  # [s(/tp), b, h]
