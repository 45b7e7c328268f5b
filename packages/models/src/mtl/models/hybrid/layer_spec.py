"""The hybrid layer's ``ModuleSpec``: gpt's attention, MLP and MoE specs (taken from gpt's layer
spec, so the backend's leaves and FP8 settings reach them as in gpt) beside the Mamba-2 mixer's."""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.core.config_hybrid import layer_symbols
from mtl.core.registrations import Backend
from mtl.core.spec import ModuleSpec
from mtl.models.gpt.layer_spec import layer_spec as gpt_layer_spec
from mtl.models.gpt.layer_spec import norm_spec
from mtl.models.hybrid.layer import HybridLayer, HybridLayerSubmodules
from mtl.models.initialization import output_init_std
from mtl.models.mamba.mixer import Mamba2Mixer


def mamba_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    m = config.model
    return ModuleSpec(
        Mamba2Mixer,
        {
            "hidden_size": m.hidden_size,
            "num_heads": m.mamba_num_heads,
            "head_dim": m.mamba_head_dim,
            "num_groups": m.mamba_num_groups,
            "state_dim": m.mamba_state_dim,
            "conv_kernel": m.mamba_conv_kernel,
            "chunk_size": m.mamba_chunk_size,
            "dt_min": m.mamba_dt_min,
            "norm_eps": m.norm_eps,
            "init_std": m.init_std,
            "output_init_std": output_init_std(config),
            "sequence_parallel": config.parallel.sequence_parallel,
            "column_linear": backend.column_linear,
            "row_linear": backend.row_linear,
        },
    )


def layer_spec(config: RunConfig, backend: Backend) -> ModuleSpec:
    """The spec of one hybrid layer; ``build_module(spec, layer_number=i, topology=t)`` builds the
    kind of layer ``i``'s symbol names."""
    m = config.model
    gpt = gpt_layer_spec(config, backend)
    return ModuleSpec(
        HybridLayer,
        {
            "symbols": layer_symbols(m.hybrid_pattern),
            "hidden_dropout": m.hidden_dropout,
            "sequence_parallel": config.parallel.sequence_parallel,
            "fuse_input_norm": gpt.params["fuse_input_norm"],
            "fuse_pre_mlp_norm": gpt.params["fuse_pre_mlp_norm"],
        },
        HybridLayerSubmodules(
            norm=norm_spec(config, backend, m.hidden_size),
            mamba=mamba_spec(config, backend),
            attention=gpt.submodules.self_attention,
            mlp=gpt.submodules.mlp,
            moe=gpt.submodules.moe_mlp,
        ),
    )
