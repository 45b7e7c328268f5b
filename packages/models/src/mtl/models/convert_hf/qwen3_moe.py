"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK-norm over each head, no
biases, an explicit head_dim) and Qwen2-MoE's sparse MLP layout without the shared expert
(``qwen2_moe.py``)."""

from __future__ import annotations

from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.llama import llama_like_config, llama_like_section
from mtl.models.convert_hf.moe_common import check_moe_exportable
from mtl.models.convert_hf.qwen2 import qwen2_model_section
from mtl.models.convert_hf.qwen2_moe import qwen_moe_config, qwen_moe_section


def qwen3_moe_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    if hf.get("attention_bias", False):
        raise ConfigError(
            f"{source}: attention_bias = true; mtl's biases (model.bias) would also reach the experts, which "
            "have none: convert a Qwen3-MoE checkpoint without attention biases"
        )
    qwen2_model_section(hf, source)  # refuses a sliding window the same way
    section = llama_like_section(hf, source, bias=False, qkv_bias=False)
    section.update(qwen_moe_section(hf), qk_norm=True)
    return section


def check_qwen3_moe_exportable(m) -> None:
    check_moe_exportable(m, "Qwen3MoeForCausalLM")
    if not m.qk_norm or m.bias or m.qkv_bias:
        raise ConfigError(
            "Qwen3MoeForCausalLM export needs model.qk_norm = true and no biases (have qk_norm = "
            f"{m.qk_norm}, bias = {m.bias}, qkv_bias = {m.qkv_bias})"
        )
    if m.moe_shared_expert_ffn_hidden_size:
        raise ConfigError(
            f"Qwen3MoeForCausalLM export: model.moe_shared_expert_ffn_hidden_size = {m.moe_shared_expert_ffn_hidden_size}, "
            "but Qwen3-MoE has no shared expert; export as qwen2_moe"
        )


def qwen3_moe_config(m, dtype: torch.dtype) -> dict[str, Any]:
    config = {**llama_like_config(m, dtype, "Qwen3MoeForCausalLM", "qwen3_moe"), **qwen_moe_config(m)}
    config.update(attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    return config
