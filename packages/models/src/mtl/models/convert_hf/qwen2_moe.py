"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases), and in the sparse
layers a softmax top-k router (renormalised only with ``norm_topk_prob``) over SwiGLU
experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``
(``model.moe_shared_expert_gate``). The MLP layout is Qwen3-MoE's too (``qwen3_moe.py``).

Which layers are sparse: layer i unless it is in ``mlp_only_layers``, when ``(i + 1) %
decoder_sparse_step == 0`` (our ``model.moe_layers``); the others are dense MLPs of
``intermediate_size`` (our ``model.ffn_hidden_size``). HF names inside a sparse layer's
``mlp.``: ``gate.weight`` (router), ``experts.{e}.gate_proj|up_proj|down_proj.weight``,
``shared_expert.gate_proj|up_proj|down_proj.weight``, ``shared_expert_gate.weight [1, h]``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read
from mtl.models.convert_hf.llama import (
    check_llama_like_exportable,
    dense_mlp_from_mtl,
    dense_mlp_to_mtl,
    llama_from_mtl,
    llama_to_mtl,
    swiglu_from_mtl,
    swiglu_to_mtl,
)
from mtl.models.convert_hf.moe_common import (
    check_moe_exportable,
    experts_from_mtl,
    experts_to_mtl,
    router_config,
    router_section,
)
from mtl.models.convert_hf.qwen2 import qwen2_config, qwen2_model_section

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def qwen_moe_section(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys of a Qwen2-MoE / Qwen3-MoE config.json."""
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(hf["num_hidden_layers"]) if i not in dense_only and (i + 1) % step == 0]
    section = router_section(hf, num_experts, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                             num_moe_layers=len(sparse))
    section.update(moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_layers=sparse)
    return section


def qwen_moe_config(m) -> dict[str, Any]:
    return {**router_config(m), "num_experts": m.num_experts, "moe_intermediate_size": m.moe_ffn_hidden_size,
            "norm_topk_prob": m.moe_norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.num_layers) if i not in m.moe_layers]}


def qwen_moe_mlp_to_mtl(section: dict[str, Any], i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    if i not in section["moe_layers"]:
        yield from dense_mlp_to_mtl(section, i, read)
        return
    hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
    yield ours + "router.weight", read(hf + "gate.weight")
    yield from experts_to_mtl(hf + "experts.", ours, section["num_experts"], EXPERT_NAMES, read)
    if section.get("moe_shared_expert_ffn_hidden_size"):
        yield from swiglu_to_mtl(hf + "shared_expert.", ours + "shared_experts.", read)
        yield ours + "shared_experts_gate.weight", read(hf + "shared_expert_gate.weight")


def qwen_moe_mlp_from_mtl(m, i: int, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    if i not in m.moe_layers:
        yield from dense_mlp_from_mtl(m, i, read)
        return
    hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
    yield hf + "gate.weight", read(ours + "router.weight")
    yield from experts_from_mtl(hf + "experts.", ours, m.num_experts, EXPERT_NAMES, read)
    if m.moe_shared_expert_ffn_hidden_size:
        yield from swiglu_from_mtl(hf + "shared_expert.", ours + "shared_experts.", read)
        yield hf + "shared_expert_gate.weight", read(ours + "shared_experts_gate.weight")


qwen_moe_to_mtl = partial(llama_to_mtl, mlp_to_mtl=qwen_moe_mlp_to_mtl)
qwen_moe_from_mtl = partial(llama_from_mtl, mlp_from_mtl=qwen_moe_mlp_from_mtl)


def qwen2_moe_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    section = qwen2_model_section(hf, source)
    if not hf.get("qkv_bias", True):
        section["qkv_bias"] = False
    shared = hf.get("shared_expert_intermediate_size") or 0
    if not shared:
        raise ConfigError(f"{source}: shared_expert_intermediate_size = {shared}; Qwen2-MoE always has a shared expert")
    section.update(qwen_moe_section(hf), moe_shared_expert_ffn_hidden_size=shared, moe_shared_expert_gate=True)
    return section


def check_qwen2_moe_exportable(m) -> None:
    # q/k/v biases alone (the default), or none (config.json's qkv_bias = false)
    check_llama_like_exportable(m, "Qwen2MoeForCausalLM", qkv_bias_only=bool(m.qkv_bias))
    check_moe_exportable(m, "Qwen2MoeForCausalLM")
    if not (m.moe_shared_expert_ffn_hidden_size and m.moe_shared_expert_gate):
        raise ConfigError(
            "Qwen2MoeForCausalLM export needs a gated shared expert (model.moe_shared_expert_ffn_hidden_size > 0, "
            "model.moe_shared_expert_gate = true); without one export as qwen3_moe or mixtral"
        )


def qwen2_moe_config(m, dtype: torch.dtype) -> dict[str, Any]:
    config = {**qwen2_config(m, dtype), **qwen_moe_config(m)}
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", qkv_bias=bool(m.qkv_bias),
                  shared_expert_intermediate_size=m.moe_shared_expert_ffn_hidden_size)
    return config
