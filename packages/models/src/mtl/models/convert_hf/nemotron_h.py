"""Hugging Face ``NemotronHForCausalLM`` <-> the ``hybrid`` family: its ``layers_block_type`` is
our pattern (``linear_attention`` M, ``full_attention`` *, ``mlp`` -); attention without positions,
a squared-ReLU MLP, Mamba-2 mixers as in ``mamba2.py``. HF names every layer's parts ``norm`` and
``mixer``; ours keep gpt's names for attention and MLP (``mtl.models.hybrid.layer``). The MoE
layers of Nemotron-H (a sigmoid router with a score-correction bias and grouped top-k) are not
converted yet: a config with ``moe`` layers is refused."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read, fuse_qkv, split_qkv
from mtl.models.convert_hf.mamba2 import check_mamba_conversion, mamba_sizes_config, mamba_sizes_section
from mtl.models.convert_hf.mamba2 import mixer_from_mtl, mixer_to_mtl
from mtl.models.hybrid.layer import PARTS

SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
BLOCK_TYPES = {symbol: block for block, symbol in SYMBOLS.items()}
PREFIX = "backbone."  # what transformers saves NemotronHForCausalLM.model under (its released checkpoints)


def nemotron_h_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    check_mamba_conversion(hf, source, hf.get("mamba_hidden_act", "silu"))
    blocks = hf["layers_block_type"]
    unknown = sorted({b for b in blocks if b not in SYMBOLS})
    if unknown:
        raise ConfigError(f"{source}: layers_block_type has {unknown}; mtl converts {sorted(SYMBOLS)} "
                          "(Nemotron-H's MoE layers are not converted yet)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ConfigError(f"{source}: {key} = true; mtl's Nemotron-H layers have no biases")
    if hf.get("mlp_hidden_act", "relu2") != "relu2":
        raise ConfigError(f"{source}: mlp_hidden_act = {hf['mlp_hidden_act']!r}; mtl converts relu2")
    pattern = "".join(SYMBOLS[b] for b in blocks)
    heads = hf["num_attention_heads"]
    return {
        "family": "hybrid",
        "hybrid_pattern": pattern,
        "num_layers": len(pattern),
        "hidden_size": hf["hidden_size"],
        "vocab_size": hf["vocab_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "activation": "relu2",
        "position_embedding": "none",
        "bias": False,
        # HF's Nemotron-H floors dt at time_step_min in its prefill scan (its decode step does not)
        "mamba_dt_min": hf.get("time_step_min", 0.001),
        **mamba_sizes_section(hf, heads_key="mamba_num_heads", head_dim_key="mamba_head_dim",
                              state_key="ssm_state_size", chunk_default=128),
    }


def nemotron_h_to_mtl(section: dict[str, Any], read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield "embedding.word_embeddings.weight", read(PREFIX + "embeddings.weight")
    for i, symbol in enumerate(section["hybrid_pattern"]):
        hf, ours = f"{PREFIX}layers.{i}.", f"layers.{i}."
        norm_name, body_name = PARTS[symbol]
        yield ours + norm_name + ".weight", read(hf + "norm.weight")
        if symbol == "M":
            yield from mixer_to_mtl(section, hf + "mixer.", ours + "mixer.", read)
        elif symbol == "*":
            q, k, v = (read(hf + f"mixer.{p}_proj.weight") for p in "qkv")
            yield ours + "self_attention.linear_qkv.weight", fuse_qkv(q, k, v, section["num_query_groups"])
            del q, k, v
            yield ours + "self_attention.linear_proj.weight", read(hf + "mixer.o_proj.weight")
        else:
            yield ours + "mlp.linear_fc1.weight", read(hf + "mixer.up_proj.weight")
            yield ours + "mlp.linear_fc2.weight", read(hf + "mixer.down_proj.weight")
    yield "final_norm.weight", read(PREFIX + "norm_f.weight")
    if not section["tie_embeddings"]:
        yield "output_layer.weight", read("lm_head.weight")


def nemotron_h_from_mtl(m, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield PREFIX + "embeddings.weight", read("embedding.word_embeddings.weight")
    for i, symbol in enumerate(m.hybrid_pattern.replace("|", "")):
        hf, ours = f"{PREFIX}layers.{i}.", f"layers.{i}."
        norm_name, _ = PARTS[symbol]
        yield hf + "norm.weight", read(ours + norm_name + ".weight")
        if symbol == "M":
            yield from mixer_from_mtl(m, hf + "mixer.", ours + "mixer.", read)
        elif symbol == "*":
            qkv = split_qkv(read(ours + "self_attention.linear_qkv.weight"), m.num_attention_heads,
                            m.num_query_groups, m.head_dim)
            for p, tensor in zip("qkv", qkv):
                yield hf + f"mixer.{p}_proj.weight", tensor
            yield hf + "mixer.o_proj.weight", read(ours + "self_attention.linear_proj.weight")
        else:
            yield hf + "mixer.up_proj.weight", read(ours + "mlp.linear_fc1.weight")
            yield hf + "mixer.down_proj.weight", read(ours + "mlp.linear_fc2.weight")
    yield PREFIX + "norm_f.weight", read("final_norm.weight")
    if not m.tie_embeddings:
        yield "lm_head.weight", read("output_layer.weight")


def check_nemotron_h_exportable(m) -> None:
    symbols = set(m.hybrid_pattern.replace("|", ""))
    if "E" in symbols:
        raise ConfigError(f"model.hybrid_pattern = {m.hybrid_pattern!r} has MoE layers 'E', which mtl does not "
                          "export to nemotron_h yet")
    if "-" in symbols and m.activation != "relu2":
        raise ConfigError(f"model.activation = {m.activation!r}: Nemotron-H's MLP is relu2")
    if "*" in symbols and m.position_embedding != "none":
        raise ConfigError(f"model.position_embedding = {m.position_embedding!r}: Nemotron-H's attention has no "
                          "positions (set it to 'none')")
    if m.bias:
        raise ConfigError("model.bias = true: Nemotron-H's layers have no biases")


def nemotron_h_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "layers_block_type": [BLOCK_TYPES[s] for s in m.hybrid_pattern.replace("|", "")],
        "hidden_size": m.hidden_size,
        "vocab_size": m.vocab_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "intermediate_size": m.ffn_hidden_size,
        "max_position_embeddings": m.max_position_embeddings,
        "mlp_hidden_act": "relu2",
        "attention_bias": False,
        "mlp_bias": False,
        "time_step_min": m.mamba_dt_min,
        **mamba_sizes_config(m, heads_key="mamba_num_heads", head_dim_key="mamba_head_dim", state_key="ssm_state_size"),
        "dtype": str(dtype).removeprefix("torch."),
    }
