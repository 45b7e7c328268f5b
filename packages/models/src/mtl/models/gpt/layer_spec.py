"""The GPT transformer layer as a ``ModuleSpec`` tree whose leaves are the backend's.

Every number comes from the resolved config; only the layer number and the topology are
given at build time. A backend swaps the leaves (linears, norms, core attention), never the
tree. Where a norm feeds a linear the spec asks for the backend's fused leaf
(``norm_column_linear`` for QKV, ``norm_mlp`` for the MLP, else ``norm_column_linear`` for fc1)
and falls back to the separate pair; the norm stays at its place in the tree either way, so
parameter names do not depend on the backend (``mtl.core.registrations.Backend``).

With ``model.num_experts > 0`` the MLP of the layers in ``model.moe_layers`` is an
``MoELayer`` (router, grouped experts, optional shared expert built from the backend's
linears); the others keep the dense MLP. A fused pre-MLP norm is handed to the MoE layer,
which applies it before routing.
"""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.core.registrations import Backend, Fp8Settings
from mtl.core.spec import ModuleSpec
from mtl.models.gpt.attention import SelfAttention, SelfAttentionSubmodules
from mtl.models.gpt.mlp import MLP, MLPSubmodules
from mtl.models.gpt.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from mtl.models.initialization import output_init_std
from mtl.models.moe import MoELayer, MoESubmodules


def norm_spec(config: RunConfig, backend: Backend, size: int) -> ModuleSpec:
    """A norm over ``size`` features (the sequence-parallel keywords are added at build time)."""
    m = config.model
    params = {"hidden_size": size, "kind": m.normalization, "eps": m.norm_eps}
    return ModuleSpec(backend.norm, params)


def layer_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    """The spec of one transformer layer; ``build_module(spec, layer_number=i, topology=t)``."""
    m, sp = config.model, config.parallel.sequence_parallel
    fp8 = Fp8Settings.from_train_config(config.train)

    def linear(factory):
        """The backend's linear factory, told the FP8 settings when there are any (a backend
        without FP8 never receives the keyword: resolve refused the config already)."""
        return ModuleSpec(factory, {"fp8": fp8}) if fp8 is not None else factory

    fuse_input_norm = backend.norm_column_linear is not None
    fuse_pre_mlp_norm = backend.norm_mlp is not None or backend.norm_column_linear is not None
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
            linear_qkv=linear(backend.norm_column_linear if fuse_input_norm else backend.column_linear),
            core_attention=backend.core_attention,
            linear_proj=linear(backend.row_linear),
            q_norm=qk_norm,
            k_norm=qk_norm,
        ),
    )
    mlp_params = {
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "activation": m.activation,
        "bias": m.bias,
        "init_std": m.init_std,
        "output_init_std": output_init_std(config),
        "sequence_parallel": sp,
    }
    if backend.norm_mlp is not None:  # the whole block is the backend's (TE's LayerNormMLP)
        mlp = ModuleSpec(backend.norm_mlp, {**mlp_params, **({"fp8": fp8} if fp8 is not None else {})})
    else:
        fc1 = backend.norm_column_linear if fuse_pre_mlp_norm else backend.column_linear
        mlp = ModuleSpec(MLP, mlp_params, MLPSubmodules(linear_fc1=linear(fc1), linear_fc2=linear(backend.row_linear)))
    return ModuleSpec(
        TransformerLayer,
        {
            "hidden_dropout": m.hidden_dropout,
            "sequence_parallel": sp,
            "fuse_input_norm": fuse_input_norm,
            "fuse_pre_mlp_norm": fuse_pre_mlp_norm,
            "moe_layers": tuple(m.moe_layers or ()),
        },
        TransformerLayerSubmodules(
            input_norm=norm_spec(config, backend, m.hidden_size),
            self_attention=attention,
            pre_mlp_norm=norm_spec(config, backend, m.hidden_size),
            mlp=mlp,
            moe_mlp=moe_spec(config, backend, linear) if m.num_experts else None,
        ),
    )


def moe_spec(config: RunConfig, backend: Backend, linear) -> ModuleSpec:
    """The MoE MLP; ``linear`` wraps a backend factory with the FP8 settings (the shared
    expert's linears are the backend's, the experts' grouped GEMMs mtl's own)."""
    m = config.model
    shared = None
    if m.moe_shared_expert_ffn_hidden_size:
        shared = ModuleSpec(
            MLP,
            {
                "hidden_size": m.hidden_size,
                "ffn_hidden_size": m.moe_shared_expert_ffn_hidden_size,
                "activation": m.activation,
                "bias": False,
                "init_std": m.init_std,
                "output_init_std": output_init_std(config),
                "sequence_parallel": config.parallel.sequence_parallel,
            },
            MLPSubmodules(linear_fc1=linear(backend.column_linear), linear_fc2=linear(backend.row_linear)),
        )
    return ModuleSpec(
        MoELayer,
        {
            "hidden_size": m.hidden_size,
            "num_experts": m.num_experts,
            "top_k": m.moe_top_k,
            "ffn_hidden_size": m.moe_ffn_hidden_size,
            "activation": m.activation,
            "router": m.moe_router,
            "norm_topk_prob": m.moe_norm_topk_prob,
            "aux_loss_coeff": m.moe_aux_loss_coeff,
            "z_loss_coeff": m.moe_z_loss_coeff,
            "capacity_factor": m.moe_capacity_factor,
            "shared_expert_gate": m.moe_shared_expert_gate,
            "router_expert_bias": m.moe_router_expert_bias,
            "router_scaling_factor": m.moe_router_scaling_factor,
            "router_num_groups": m.moe_router_num_groups,
            "router_group_top_k": m.moe_router_group_topk,
            "router_bias_update_rate": m.moe_router_bias_update_rate,
            "init_std": m.init_std,
            "output_init_std": output_init_std(config),
            "sequence_parallel": config.parallel.sequence_parallel,
            # the schedule divides each micro-batch's loss by their number (aux_loss.py)
            "aux_loss_scale": 1.0 / (config.train.num_micro_batches or 1),
        },
        MoESubmodules(shared_experts=shared),
    )
