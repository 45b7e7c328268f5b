"""GPT-2 (``GPT2LMHeadModel``) <-> mtl ``gpt`` family.

GPT-2 stores its linears as ``Conv1D`` (weight ``[in, out]``, the transpose of ours) and its
attention input projection ``c_attn`` as ``[q | k | v]`` columns, each head-major; we fuse
group-major (for GPT-2 a group is one head). The LM head is tied to ``wte``.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

# HF activation names: exact (erf) GELU is ours; the tanh approximations differ by < 1e-3
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def gpt2_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Our ``[model]`` keys for a GPT-2 config.json."""
    for key, supported in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(key, supported) != supported:
            raise ConfigError(f"{source}: {key} = {hf[key]} is not supported (mtl GPT needs {supported})")
    activation = hf.get("activation_function", "gelu_new")
    if activation in TANH_GELUS:
        log.warning(
            "%s: activation_function = %s (tanh-approximated GELU) is imported as exact GELU; "
            "outputs differ slightly (< 1e-3 per activation) from Hugging Face's",
            source,
            activation,
        )
    elif activation != "gelu":
        raise ConfigError(f"{source}: activation_function = {activation!r} is not a GELU; mtl GPT-2 uses gelu")
    hidden = hf["n_embd"]
    return {
        "family": "gpt",
        "num_layers": hf["n_layer"],
        "hidden_size": hidden,
        "num_attention_heads": hf["n_head"],
        "num_query_groups": hf["n_head"],
        "head_dim": hidden // hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf["n_positions"],
        "seq_length": hf["n_positions"],
        "normalization": "layernorm",
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "activation": "gelu",
        "position_embedding": "learned",
        "bias": True,
        "tie_embeddings": True,
        "qk_norm": False,
    }


def gpt2_to_mtl(hf: dict[str, Any], tensors: dict[str, torch.Tensor], source: str, tp: int):
    section = gpt2_model_section(hf, source)
    heads = section["num_attention_heads"]
    hidden = section["hidden_size"]
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    tensors.pop("lm_head.weight", None)  # tied to wte
    state = {
        "embedding.word_embeddings.weight": pad_vocab_rows(take(tensors, "wte.weight", source), padded_vocab_size(section, tp)),
        "embedding.position_embeddings.weight": take(tensors, "wpe.weight", source),
        "final_norm.weight": take(tensors, "ln_f.weight", source),
        "final_norm.bias": take(tensors, "ln_f.bias", source),
    }
    for i in range(section["num_layers"]):
        hf_layer, ours = f"h.{i}.", f"layers.{i}."

        def pop(name: str, prefix: str = hf_layer) -> torch.Tensor:
            return take(tensors, prefix + name, source)

        for suffix in ("weight", "bias"):
            state[ours + f"input_norm.{suffix}"] = pop(f"ln_1.{suffix}")
            state[ours + f"pre_mlp_norm.{suffix}"] = pop(f"ln_2.{suffix}")
        c_attn_w = pop("attn.c_attn.weight").t()  # Conv1D [h, 3h] -> Linear [3h, h]
        c_attn_b = pop("attn.c_attn.bias")
        state[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(*c_attn_w.split(hidden), num_groups=heads)
        state[ours + "self_attention.linear_qkv.bias"] = fuse_qkv(*c_attn_b.split(hidden), num_groups=heads)
        state[ours + "self_attention.linear_proj.weight"] = pop("attn.c_proj.weight").t().contiguous()
        state[ours + "self_attention.linear_proj.bias"] = pop("attn.c_proj.bias")
        state[ours + "mlp.linear_fc1.weight"] = pop("mlp.c_fc.weight").t().contiguous()
        state[ours + "mlp.linear_fc1.bias"] = pop("mlp.c_fc.bias")
        state[ours + "mlp.linear_fc2.weight"] = pop("mlp.c_proj.weight").t().contiguous()
        state[ours + "mlp.linear_fc2.bias"] = pop("mlp.c_proj.bias")
        for buffer in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers of old checkpoints
            tensors.pop(hf_layer + buffer, None)
    require_consumed(tensors, source)
    return section, state


def gpt2_from_mtl(model_config, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    check_resolved(model_config)
    m = model_config
    if m.num_query_groups != m.num_attention_heads or m.head_dim * m.num_attention_heads != m.hidden_size:
        raise ConfigError(
            "GPT-2 export needs plain multi-head attention with head_dim * heads == hidden_size "
            f"(have num_query_groups = {m.num_query_groups}, heads = {m.num_attention_heads}, "
            f"head_dim = {m.head_dim}, hidden_size = {m.hidden_size})"
        )
    if not m.bias or not m.tie_embeddings or m.qk_norm:
        raise ConfigError(
            f"GPT-2 export needs model.bias = true, model.tie_embeddings = true, model.qk_norm = false "
            f"(have {m.bias}, {m.tie_embeddings}, {m.qk_norm})"
        )
    dtype = state["embedding.word_embeddings.weight"].dtype
    tensors = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"][: m.vocab_size],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["final_norm.weight"],
        "transformer.ln_f.bias": state["final_norm.bias"],
    }
    for i in range(m.num_layers):
        hf_layer, ours = f"transformer.h.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias"):
            tensors[hf_layer + f"ln_1.{suffix}"] = state[ours + f"input_norm.{suffix}"]
            tensors[hf_layer + f"ln_2.{suffix}"] = state[ours + f"pre_mlp_norm.{suffix}"]
        split = (m.num_attention_heads, m.num_query_groups, m.head_dim)
        qkv_w = split_qkv(state[ours + "self_attention.linear_qkv.weight"], *split)
        qkv_b = split_qkv(state[ours + "self_attention.linear_qkv.bias"], *split)
        tensors[hf_layer + "attn.c_attn.weight"] = torch.cat(qkv_w, dim=0).t()  # -> Conv1D [h, 3h]
        tensors[hf_layer + "attn.c_attn.bias"] = torch.cat(qkv_b, dim=0)
        tensors[hf_layer + "attn.c_proj.weight"] = state[ours + "self_attention.linear_proj.weight"].t()
        tensors[hf_layer + "attn.c_proj.bias"] = state[ours + "self_attention.linear_proj.bias"]
        tensors[hf_layer + "mlp.c_fc.weight"] = state[ours + "mlp.linear_fc1.weight"].t()
        tensors[hf_layer + "mlp.c_fc.bias"] = state[ours + "mlp.linear_fc1.bias"]
        tensors[hf_layer + "mlp.c_proj.weight"] = state[ours + "mlp.linear_fc2.weight"].t()
        tensors[hf_layer + "mlp.c_proj.bias"] = state[ours + "mlp.linear_fc2.bias"]
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn_hidden_size,
        "n_positions": m.max_position_embeddings,
        "vocab_size": m.vocab_size,
        "layer_norm_epsilon": m.norm_eps,
        "activation_function": "gelu",  # exact GELU, as our MLP computes it
        "tie_word_embeddings": True,
        "attn_pdrop": m.attention_dropout,
        "resid_pdrop": m.hidden_dropout,
        "embd_pdrop": m.hidden_dropout,
        "initializer_range": m.init_std,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return hf_config, tensors
