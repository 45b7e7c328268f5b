"""Mistral (``MistralForCausalLM``): Llama's tensors and config, plus a sliding window that mtl
does not implement. A window at least as long as every sequence the model sees is full causal
attention, so such a checkpoint (and one with ``sliding_window: null``) converts exactly."""

from __future__ import annotations

from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.llama import check_llama_like_exportable, llama_like_config, llama_like_section


def mistral_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    section = llama_like_section(hf, source, bias=False, qkv_bias=False)
    window = hf.get("sliding_window")
    longest = section["max_position_embeddings"]
    if window is not None and window < longest:
        # HF masks keys at distance >= window: with sequences of at most `window` tokens none is masked
        raise ConfigError(
            f"{source}: sliding_window = {window} is smaller than max_position_embeddings = {longest}, and mtl "
            "has no sliding-window attention; to use the model on sequences of at most "
            f"{window} tokens (where the window changes nothing), set max_position_embeddings to {window} "
            "in config.json, or set sliding_window to null if the model was trained without it"
        )
    return section


def check_mistral_exportable(m) -> None:
    check_llama_like_exportable(m, "MistralForCausalLM", qkv_bias_only=False)
    if m.bias:
        raise ConfigError("MistralForCausalLM export: model.bias = true has no place in Mistral (no biases)")


def mistral_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {**llama_like_config(m, dtype, "MistralForCausalLM", "mistral"), "sliding_window": None}
