"""GPT-2 (``GPT2LMHeadModel``) <-> mtl ``gpt`` family.

GPT-2 stores its linears as ``Conv1D`` (weight ``[in, out]``, the transpose of ours) and its
attention input projection ``c_attn`` as ``[q | k | v]`` columns, each head-major; we fuse
group-major (for GPT-2 a group is one head). The LM head is tied to ``wte``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read, check_resolved, fuse_qkv, split_qkv

log = logging.getLogger(__name__)

# HF activation names: exact (erf) GELU is ours; the tanh approximations differ by < 1e-3
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# the tied LM head, and the causal-mask buffers of old checkpoints
IGNORED = re.compile(r"^(lm_head\.weight|(transformer\.)?h\.\d+\.attn\.(masked_)?bias)$")


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


def gpt2_to_mtl(section: dict[str, Any], read: Read, prefix: str = "transformer.") -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors from GPT-2's, one at a time (``prefix``: "" in checkpoints saved without it)."""
    heads, hidden = section["num_attention_heads"], section["hidden_size"]
    yield "embedding.word_embeddings.weight", read(prefix + "wte.weight")
    yield "embedding.position_embeddings.weight", read(prefix + "wpe.weight")
    for i in range(section["num_layers"]):
        hf_layer, ours = f"{prefix}h.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias"):
            yield ours + f"input_norm.{suffix}", read(hf_layer + f"ln_1.{suffix}")
        c_attn_w = read(hf_layer + "attn.c_attn.weight").t()  # Conv1D [h, 3h] -> Linear [3h, h]
        yield ours + "self_attention.linear_qkv.weight", fuse_qkv(*c_attn_w.split(hidden), num_groups=heads)
        del c_attn_w
        c_attn_b = read(hf_layer + "attn.c_attn.bias")
        yield ours + "self_attention.linear_qkv.bias", fuse_qkv(*c_attn_b.split(hidden), num_groups=heads)
        yield ours + "self_attention.linear_proj.weight", read(hf_layer + "attn.c_proj.weight").t().contiguous()
        yield ours + "self_attention.linear_proj.bias", read(hf_layer + "attn.c_proj.bias")
        for suffix in ("weight", "bias"):
            yield ours + f"pre_mlp_norm.{suffix}", read(hf_layer + f"ln_2.{suffix}")
        yield ours + "mlp.linear_fc1.weight", read(hf_layer + "mlp.c_fc.weight").t().contiguous()
        yield ours + "mlp.linear_fc1.bias", read(hf_layer + "mlp.c_fc.bias")
        yield ours + "mlp.linear_fc2.weight", read(hf_layer + "mlp.c_proj.weight").t().contiguous()
        yield ours + "mlp.linear_fc2.bias", read(hf_layer + "mlp.c_proj.bias")
    yield "final_norm.weight", read(prefix + "ln_f.weight")
    yield "final_norm.bias", read(prefix + "ln_f.bias")


def check_gpt2_exportable(m) -> None:
    check_resolved(m)
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


def gpt2_from_mtl(m, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-2's tensors from ours, one at a time (the layer's q/k/v from one fused read)."""
    yield "transformer.wte.weight", read("embedding.word_embeddings.weight")
    yield "transformer.wpe.weight", read("embedding.position_embeddings.weight")
    split = (m.num_attention_heads, m.num_query_groups, m.head_dim)
    for i in range(m.num_layers):
        hf_layer, ours = f"transformer.h.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias"):
            yield hf_layer + f"ln_1.{suffix}", read(ours + f"input_norm.{suffix}")
            yield hf_layer + f"ln_2.{suffix}", read(ours + f"pre_mlp_norm.{suffix}")
        yield hf_layer + "attn.c_attn.weight", torch.cat(  # -> Conv1D [h, 3h]
            split_qkv(read(ours + "self_attention.linear_qkv.weight"), *split), dim=0).t()
        yield hf_layer + "attn.c_attn.bias", torch.cat(split_qkv(read(ours + "self_attention.linear_qkv.bias"), *split))
        yield hf_layer + "attn.c_proj.weight", read(ours + "self_attention.linear_proj.weight").t()
        yield hf_layer + "attn.c_proj.bias", read(ours + "self_attention.linear_proj.bias")
        yield hf_layer + "mlp.c_fc.weight", read(ours + "mlp.linear_fc1.weight").t()
        yield hf_layer + "mlp.c_fc.bias", read(ours + "mlp.linear_fc1.bias")
        yield hf_layer + "mlp.c_proj.weight", read(ours + "mlp.linear_fc2.weight").t()
        yield hf_layer + "mlp.c_proj.bias", read(ours + "mlp.linear_fc2.bias")
    yield "transformer.ln_f.weight", read("final_norm.weight")
    yield "transformer.ln_f.bias", read("final_norm.bias")


def gpt2_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {
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
