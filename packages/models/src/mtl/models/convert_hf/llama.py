"""Llama (``LlamaForCausalLM``) <-> mtl ``gpt`` family.

HF keeps q/k/v as separate head-major projections already permuted to the rotate-half RoPE
convention that ``mtl.models.gpt.rope`` implements, so no permutation is needed: we fuse
q/k/v group-major and stack gate/up as the ``[2, ffn, h]`` fc1.
"""

from __future__ import annotations

from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import (
    check_resolved,
    fuse_qkv,
    pad_vocab_rows,
    padded_vocab_size,
    require_consumed,
    split_qkv,
    take,
)


def _rope_theta(hf: dict[str, Any], source: str) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ConfigError(
            f"{source}: rope type {rope_type!r} (scaled RoPE) is not supported; mtl implements plain RoPE"
        )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Our ``[model]`` keys for a Llama config.json."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act = {hf['hidden_act']!r}; mtl's Llama MLP is SwiGLU (silu)")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConfigError(
            f"{source}: attention_bias = {attention_bias} and mlp_bias = {mlp_bias} differ; "
            "mtl has one switch (model.bias) for both"
        )
    heads = hf["num_attention_heads"]
    return {
        "family": "gpt",
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["max_position_embeddings"],
        "normalization": "rmsnorm",
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "activation": "swiglu",
        "position_embedding": "rope",
        "rope_theta": _rope_theta(hf, source),
        "bias": bool(attention_bias),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": False,
    }


def llama_to_mtl(hf: dict[str, Any], tensors: dict[str, torch.Tensor], source: str, tp: int):
    section = llama_model_section(hf, source)
    groups = section["num_query_groups"]
    padded = padded_vocab_size(section, tp)
    state = {
        "embedding.word_embeddings.weight": pad_vocab_rows(take(tensors, "model.embed_tokens.weight", source), padded),
        "final_norm.weight": take(tensors, "model.norm.weight", source),
    }
    if section["tie_embeddings"]:
        tensors.pop("lm_head.weight", None)
    else:
        state["output_layer.weight"] = pad_vocab_rows(take(tensors, "lm_head.weight", source), padded)
    suffixes = ("weight", "bias") if section["bias"] else ("weight",)
    for i in range(section["num_layers"]):
        hf_layer, ours = f"model.layers.{i}.", f"layers.{i}."

        def pop(name: str, prefix: str = hf_layer) -> torch.Tensor:
            return take(tensors, prefix + name, source)

        state[ours + "input_norm.weight"] = pop("input_layernorm.weight")
        state[ours + "pre_mlp_norm.weight"] = pop("post_attention_layernorm.weight")
        for suffix in suffixes:
            q, k, v = (pop(f"self_attn.{p}_proj.{suffix}") for p in "qkv")
            state[ours + f"self_attention.linear_qkv.{suffix}"] = fuse_qkv(q, k, v, num_groups=groups)
            state[ours + f"self_attention.linear_proj.{suffix}"] = pop(f"self_attn.o_proj.{suffix}")
            # [2, ffn, ...]: gate then up, the layout of our fused SwiGLU fc1
            state[ours + f"mlp.linear_fc1.{suffix}"] = torch.stack((pop(f"mlp.gate_proj.{suffix}"), pop(f"mlp.up_proj.{suffix}")))
            state[ours + f"mlp.linear_fc2.{suffix}"] = pop(f"mlp.down_proj.{suffix}")
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:  # a buffer in old checkpoints
        tensors.pop(name)
    require_consumed(tensors, source)
    return section, state


def llama_from_mtl(model_config, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    check_resolved(model_config)
    m = model_config
    if m.qk_norm:
        raise ConfigError("Llama export: model.qk_norm = true has no place in LlamaForCausalLM")
    vocab = m.vocab_size
    tensors = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": state["final_norm.weight"],
    }
    if not m.tie_embeddings:
        tensors["lm_head.weight"] = state["output_layer.weight"][:vocab]
    suffixes = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.num_layers):
        hf_layer, ours = f"model.layers.{i}.", f"layers.{i}."
        tensors[hf_layer + "input_layernorm.weight"] = state[ours + "input_norm.weight"]
        tensors[hf_layer + "post_attention_layernorm.weight"] = state[ours + "pre_mlp_norm.weight"]
        for suffix in suffixes:
            q, k, v = split_qkv(
                state[ours + f"self_attention.linear_qkv.{suffix}"], m.num_attention_heads, m.num_query_groups, m.head_dim
            )
            tensors[hf_layer + f"self_attn.q_proj.{suffix}"] = q
            tensors[hf_layer + f"self_attn.k_proj.{suffix}"] = k
            tensors[hf_layer + f"self_attn.v_proj.{suffix}"] = v
            tensors[hf_layer + f"self_attn.o_proj.{suffix}"] = state[ours + f"self_attention.linear_proj.{suffix}"]
            gate, up = state[ours + f"mlp.linear_fc1.{suffix}"]
            tensors[hf_layer + f"mlp.gate_proj.{suffix}"] = gate
            tensors[hf_layer + f"mlp.up_proj.{suffix}"] = up
            tensors[hf_layer + f"mlp.down_proj.{suffix}"] = state[ours + f"mlp.linear_fc2.{suffix}"]
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_position_embeddings,
        "vocab_size": vocab,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        "rope_theta": m.rope_theta,  # read by transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": m.bias,
        "mlp_bias": m.bias,
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "dtype": str(state["embedding.word_embeddings.weight"].dtype).removeprefix("torch."),
    }
    return hf_config, tensors
