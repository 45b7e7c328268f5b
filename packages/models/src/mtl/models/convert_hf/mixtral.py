"""Mixtral (``MixtralForCausalLM``): Mistral's attention and norms, and in every layer a
softmax top-k router (top-k renormalised) over SwiGLU experts, no shared expert.

HF names: ``model.layers.{i}.block_sparse_moe.gate.weight [E, h]`` (our ``mlp.router.weight``)
and ``block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (gate, up, down)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read
from mtl.models.convert_hf.llama import check_llama_like_exportable, llama_from_mtl, llama_to_mtl
from mtl.models.convert_hf.mistral import mistral_config, mistral_model_section
from mtl.models.convert_hf.moe_common import (
    check_moe_exportable,
    experts_from_mtl,
    experts_to_mtl,
    router_config,
    router_section,
)

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def mixtral_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    section = mistral_model_section(hf, source)
    section.update(router_section(hf, hf["num_local_experts"], norm_topk_prob=True,
                                  num_moe_layers=hf["num_hidden_layers"]))
    section.update(moe_ffn_hidden_size=hf["intermediate_size"], moe_layer_freq=1)
    return section


def _mlp_to_mtl(section: dict[str, Any], i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    hf, ours = f"model.layers.{i}.block_sparse_moe.", f"layers.{i}.mlp."
    yield ours + "router.weight", read(hf + "gate.weight")
    yield from experts_to_mtl(hf + "experts.", ours, section["num_experts"], EXPERT_NAMES, read)


def _mlp_from_mtl(m, i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    hf, ours = f"model.layers.{i}.block_sparse_moe.", f"layers.{i}.mlp."
    yield hf + "gate.weight", read(ours + "router.weight")
    yield from experts_from_mtl(hf + "experts.", ours, m.num_experts, EXPERT_NAMES, read)


mixtral_to_mtl = partial(llama_to_mtl, mlp_to_mtl=_mlp_to_mtl)
mixtral_from_mtl = partial(llama_from_mtl, mlp_from_mtl=_mlp_from_mtl)


def check_mixtral_exportable(m) -> None:
    check_llama_like_exportable(m, "MixtralForCausalLM", qkv_bias_only=False)
    check_moe_exportable(m, "MixtralForCausalLM", norm_topk_prob=True)
    if list(m.moe_layers) != list(range(m.num_layers)):
        raise ConfigError(f"MixtralForCausalLM export: every layer is MoE in Mixtral (model.moe_layers = {m.moe_layers})")
    if m.moe_shared_expert_ffn_hidden_size:
        raise ConfigError(
            f"MixtralForCausalLM export: model.moe_shared_expert_ffn_hidden_size = {m.moe_shared_expert_ffn_hidden_size}, "
            "but Mixtral has no shared expert; models with one export as qwen2_moe"
        )


def mixtral_config(m, dtype: torch.dtype) -> dict[str, Any]:
    config = {**mistral_config(m, dtype), **router_config(m)}
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=m.num_experts,
                  intermediate_size=m.moe_ffn_hidden_size, router_jitter_noise=0.0)
    return config
