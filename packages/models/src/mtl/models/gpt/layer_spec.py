"""The GPT transformer layer as a ``ModuleSpec`` tree whose leaves are the backend's.

Every number comes from the resolved config; only the layer number and the topology are
given at build time. A backend swaps the leaves (linears, norms, core attention), never the
tree.
"""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec
from mtl.models.gpt.attention import SelfAttention, SelfAttentionSubmodules
from mtl.models.gpt.mlp import MLP, MLPSubmodules
from mtl.models.gpt.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from mtl.models.initialization import output_init_std


def norm_spec(config: RunConfig, backend: Backend, size: int) -> ModuleSpec:
    """A norm over ``size`` features (the sequence-parallel keywords are added at build time)."""
    m = config.model
    params = {"hidden_size": size, "kind": m.normalization, "eps": m.norm_eps}
    return ModuleSpec(backend.norm, params)


def layer_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    """The spec of one transformer layer; ``build_module(spec, layer_number=i, topology=t)``."""
    m, sp = config.model, config.parallel.sequence_parallel
    qk_norm = norm_spec(config, backend, m.head_dim) if m.qk_norm else None
    attention = ModuleSpec(
        SelfAttention,
        {
            "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_query_groups,
            "head_dim": m.head_dim,
            "bias": m.bias,
            # Qwen2 style: biases on the query/key/value projection alone
            "qkv_bias": m.bias or m.qkv_bias,
            "init_std": m.init_std,
            "output_init_std": output_init_std(config),
            "attention_dropout": m.attention_dropout,
            "sequence_parallel": sp,
            "recompute_core_attention": config.train.recompute == "selective",
        },
        SelfAttentionSubmodules(
            linear_qkv=backend.column_linear,
            core_attention=backend.core_attention,
            linear_proj=backend.row_linear,
            q_norm=qk_norm,
            k_norm=qk_norm,
        ),
    )
    mlp = ModuleSpec(
        MLP,
        {
            "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size,
            "activation": m.activation,
            "bias": m.bias,
            "init_std": m.init_std,
            "output_init_std": output_init_std(config),
            "sequence_parallel": sp,
        },
        MLPSubmodules(linear_fc1=backend.column_linear, linear_fc2=backend.row_linear),
    )
    return ModuleSpec(
        TransformerLayer,
        {"hidden_dropout": m.hidden_dropout, "sequence_parallel": sp},
        TransformerLayerSubmodules(
            input_norm=norm_spec(config, backend, m.hidden_size),
            self_attention=attention,
            pre_mlp_norm=norm_spec(config, backend, m.hidden_size),
            mlp=mlp,
        ),
    )
