"""Qwen2 (``Qwen2ForCausalLM``): Llama's tensors with biases on q/k/v alone (``model.qkv_bias``).
Qwen2's optional sliding window (``use_sliding_window: true``) is refused: mtl has none."""

from __future__ import annotations

from typing import Any

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.llama import check_llama_like_exportable, llama_like_config, llama_like_section


def qwen2_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    sliding_layers = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if hf.get("use_sliding_window", False) or sliding_layers:
        detail = f" (layer_types marks layers {sliding_layers[:4]})" if sliding_layers else ""
        raise ConfigError(
            f"{source}: use_sliding_window = true{detail}: mtl has no sliding-window attention; "
            "convert a Qwen2 checkpoint with use_sliding_window = false"
        )
    return llama_like_section(hf, source, bias=False, qkv_bias=True)


def check_qwen2_exportable(m) -> None:
    check_llama_like_exportable(m, "Qwen2ForCausalLM", qkv_bias_only=True)


def qwen2_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {**llama_like_config(m, dtype, "Qwen2ForCausalLM", "qwen2"), "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": m.num_layers}
