"""Llama-style checkpoints (``LlamaForCausalLM`` and the Mistral and Qwen2 variants) <-> mtl
``gpt`` family: the tensor mapping they share, and Llama's config.json.

HF keeps q/k/v as separate head-major projections already permuted to the rotate-half RoPE
convention that ``mtl.models.gpt.rope`` implements, so no permutation is needed: we fuse
q/k/v group-major and stack gate/up as the ``[2, ffn, h]`` fc1. Biases: ``model.bias`` puts
them on every linear (Llama's ``attention_bias = mlp_bias = true``), ``model.qkv_bias`` on
q/k/v alone (Qwen2).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read, check_resolved, fuse_qkv, split_qkv

# a tied LM head saved anyway, and the RoPE buffer of old checkpoints
IGNORED_TIED = re.compile(r"^(lm_head\.weight|model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")
IGNORED_UNTIED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
LLAMA3_ROPE_KEYS = {  # HF rope_parameters key -> our model key
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
}


def rope_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE keys from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_ROPE_KEYS if key not in params]
        if missing:
            raise ConfigError(f"{source}: rope type 'llama3' needs {', '.join(missing)} in rope_parameters/rope_scaling")
        section = {"rope_theta": theta, "rope_scaling": "llama3"}
        section.update({ours: params[key] for key, ours in LLAMA3_ROPE_KEYS.items()})
        return section
    raise ConfigError(
        f"{source}: rope type {rope_type!r} (rope_parameters/rope_scaling) is not supported; mtl implements "
        "plain RoPE ('default') and Llama 3's scaling ('llama3')"
    )


def rope_config(m) -> dict[str, Any]:
    """The config.json RoPE keys of a resolved model config (both transformers 4 and 5 read them)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
        params["rope_type"] = "llama3"
        params.update({key: getattr(m, ours) for key, ours in LLAMA3_ROPE_KEYS.items()})
    elif m.rope_scaling != "none":
        raise ConfigError(f"model.rope_scaling = {m.rope_scaling!r} has no Hugging Face equivalent")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if m.rope_scaling != "none" else None
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def llama_like_section(hf: dict[str, Any], source: str, *, bias: bool, qkv_bias: bool) -> dict[str, Any]:
    """The ``[model]`` keys every Llama-style config.json shares."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act = {hf['hidden_act']!r}; mtl's Llama MLP is SwiGLU (silu)")
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
        **rope_section(hf, source),
        "bias": bias,
        "qkv_bias": qkv_bias,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": False,
    }


def llama_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConfigError(
            f"{source}: attention_bias = {attention_bias} and mlp_bias = {mlp_bias} differ; "
            "mtl has one switch (model.bias) for both"
        )
    return llama_like_section(hf, source, bias=bool(attention_bias), qkv_bias=False)


def llama_ignored(section: dict[str, Any]):
    return (IGNORED_TIED if section["tie_embeddings"] else IGNORED_UNTIED).match


def swiglu_to_mtl(hf_prefix: str, ours: str, read: Read, suffixes=("weight",)) -> Iterator[tuple[str, torch.Tensor]]:
    """A SwiGLU MLP's gate/up/down (``hf_prefix`` + ``gate_proj.weight`` ...) as our fc1 ``[2, ffn, ...]``
    (gate then up, the layout of our fused fc1) and fc2 (``ours`` + ``linear_fc1.weight`` ...)."""
    for suffix in suffixes:
        gate_up = [read(hf_prefix + f"gate_proj.{suffix}"), read(hf_prefix + f"up_proj.{suffix}")]
        yield ours + f"linear_fc1.{suffix}", torch.stack(gate_up)
        del gate_up
        yield ours + f"linear_fc2.{suffix}", read(hf_prefix + f"down_proj.{suffix}")


def swiglu_from_mtl(hf_prefix: str, ours: str, read: Read, suffixes=("weight",)) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``swiglu_to_mtl``."""
    for suffix in suffixes:
        fc1 = read(ours + f"linear_fc1.{suffix}")  # [2, ffn, ...]
        yield hf_prefix + f"gate_proj.{suffix}", fc1[0]
        yield hf_prefix + f"up_proj.{suffix}", fc1[1]
        del fc1
        yield hf_prefix + f"down_proj.{suffix}", read(ours + f"linear_fc2.{suffix}")


def dense_mlp_to_mtl(section: dict[str, Any], i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield from swiglu_to_mtl(f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", read,
                             ("weight", "bias") if section["bias"] else ("weight",))


def dense_mlp_from_mtl(m, i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield from swiglu_from_mtl(f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", read,
                               ("weight", "bias") if m.bias else ("weight",))


def llama_to_mtl(section: dict[str, Any], read: Read, mlp_to_mtl=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors from a Llama-style checkpoint's, one at a time (q/k/v and gate/up as groups).
    ``mlp_to_mtl(section, layer, read)`` converts a layer's MLP where it is not Llama's (MoE)."""
    groups = section["num_query_groups"]
    all_bias, qkv_bias = section["bias"], section["bias"] or section["qkv_bias"]
    yield "embedding.word_embeddings.weight", read("model.embed_tokens.weight")
    for i in range(section["num_layers"]):
        hf_layer, ours = f"model.layers.{i}.", f"layers.{i}."
        yield ours + "input_norm.weight", read(hf_layer + "input_layernorm.weight")
        for suffix in ("weight", "bias") if qkv_bias else ("weight",):
            qkv = [read(hf_layer + f"self_attn.{p}_proj.{suffix}") for p in "qkv"]
            yield ours + f"self_attention.linear_qkv.{suffix}", fuse_qkv(*qkv, num_groups=groups)
            del qkv  # freed before the next read
        if section.get("qk_norm"):  # Qwen3: RMSNorm over each head's dimension
            for p in "qk":
                yield ours + f"self_attention.{p}_norm.weight", read(hf_layer + f"self_attn.{p}_norm.weight")
        for suffix in ("weight", "bias") if all_bias else ("weight",):
            yield ours + f"self_attention.linear_proj.{suffix}", read(hf_layer + f"self_attn.o_proj.{suffix}")
        yield ours + "pre_mlp_norm.weight", read(hf_layer + "post_attention_layernorm.weight")
        yield from (mlp_to_mtl or dense_mlp_to_mtl)(section, i, read)
    yield "final_norm.weight", read("model.norm.weight")
    if not section["tie_embeddings"]:
        yield "output_layer.weight", read("lm_head.weight")


def check_llama_like_exportable(m, architecture: str, *, qkv_bias_only: bool) -> None:
    check_resolved(m)
    if m.qk_norm:
        raise ConfigError(f"{architecture} export: model.qk_norm = true has no place in {architecture}")
    if (m.qkv_bias and not m.bias) != qkv_bias_only:
        need = "model.qkv_bias = true with model.bias = false" if qkv_bias_only else (
            "model.qkv_bias = false (or model.bias = true)")
        raise ConfigError(
            f"{architecture} export needs {need} (have bias = {m.bias}, qkv_bias = {m.qkv_bias}); "
            "models with q/k/v biases alone export as Qwen2 (--hf-architecture qwen2)"
        )


def llama_from_mtl(m, read: Read, mlp_from_mtl=None) -> Iterator[tuple[str, torch.Tensor]]:
    """A Llama-style checkpoint's tensors from ours, one at a time (``mlp_from_mtl(m, layer,
    read)``: a layer's MLP where it is not Llama's)."""
    all_bias, qkv_bias = m.bias, m.bias or m.qkv_bias
    yield "model.embed_tokens.weight", read("embedding.word_embeddings.weight")
    for i in range(m.num_layers):
        hf_layer, ours = f"model.layers.{i}.", f"layers.{i}."
        yield hf_layer + "input_layernorm.weight", read(ours + "input_norm.weight")
        for suffix in ("weight", "bias") if qkv_bias else ("weight",):
            fused = read(ours + f"self_attention.linear_qkv.{suffix}")
            parts = list(split_qkv(fused, m.num_attention_heads, m.num_query_groups, m.head_dim))
            del fused
            for p in "qkv":
                yield hf_layer + f"self_attn.{p}_proj.{suffix}", parts.pop(0)  # dropped as it goes
        if m.qk_norm:
            for p in "qk":
                yield hf_layer + f"self_attn.{p}_norm.weight", read(ours + f"self_attention.{p}_norm.weight")
        for suffix in ("weight", "bias") if all_bias else ("weight",):
            yield hf_layer + f"self_attn.o_proj.{suffix}", read(ours + f"self_attention.linear_proj.{suffix}")
        yield hf_layer + "post_attention_layernorm.weight", read(ours + "pre_mlp_norm.weight")
        yield from (mlp_from_mtl or dense_mlp_from_mtl)(m, i, read)
    yield "model.norm.weight", read("final_norm.weight")
    if not m.tie_embeddings:
        yield "lm_head.weight", read("output_layer.weight")


def llama_like_config(m, dtype: torch.dtype, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json keys every Llama-style architecture shares."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_position_embeddings,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        **rope_config(m),
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "dtype": str(dtype).removeprefix("torch."),
    }


def check_llama_exportable(m) -> None:
    check_llama_like_exportable(m, "LlamaForCausalLM", qkv_bias_only=False)


def llama_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {**llama_like_config(m, dtype, "LlamaForCausalLM", "llama"), "attention_bias": m.bias, "mlp_bias": m.bias}
