"""Hugging Face ``NemotronHForCausalLM`` <-> the ``hybrid`` family: its ``layers_block_type`` is
our pattern (``linear_attention`` M, ``full_attention`` *, ``mlp`` -); attention without positions,
a squared-ReLU MLP, Mamba-2 mixers as in ``mamba2.py``, and ``moe`` layers E. HF names every
layer's parts ``norm`` and ``mixer``; ours keep gpt's names for attention, MLP and MoE
(``mtl.models.hybrid.layer``).

An MoE layer (HF's ``NemotronHMoE``): a sigmoid router ``gate.weight`` whose
``gate.e_score_correction_bias`` only chooses the experts (our ``router.expert_bias``,
``model.moe_router_expert_bias``), group-limited top-k, weights normalised (``norm_topk_prob``)
and scaled (``routed_scaling_factor``); non-gated squared-ReLU experts ``experts.{e}.up_proj`` /
``down_proj`` (as ``save_pretrained`` writes them) and one ungated shared expert of
``moe_shared_expert_intermediate_size`` (``n_shared_experts`` is not read by HF's model either).
HF ranks expert groups by their top two scores, Megatron and mtl by their top ``k / group_topk``:
a config with ``n_group > 1`` converts where the two agree. HF's model has no load-balancing
loss: the conversion sets ``model.moe_aux_loss_coeff = 0`` (set one to fine-tune with it).
The router's weight and bias are written in fp32, as HF keeps them. ``moe_latent_size`` (the
latent projections around the experts) is not built: such a config is refused."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read, fuse_qkv, split_qkv
from mtl.models.convert_hf.moe_common import experts_from_mtl, experts_to_mtl
from mtl.models.convert_hf.mamba2 import check_mamba_conversion, mamba_sizes_config, mamba_sizes_section
from mtl.models.convert_hf.mamba2 import mixer_from_mtl, mixer_to_mtl
from mtl.models.hybrid.layer import PARTS

SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
EXPERT_NAMES = ("up_proj", "down_proj")
HF_GROUP_RANK = 2  # HF scores each expert group by the sum of its best two (NemotronHTopkRouter)
BLOCK_TYPES = {symbol: block for block, symbol in SYMBOLS.items()}
PREFIX = "backbone."  # what transformers saves NemotronHForCausalLM.model under (its released checkpoints)


def nemotron_h_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    check_mamba_conversion(hf, source, hf.get("mamba_hidden_act", "silu"))
    blocks = hf["layers_block_type"]
    unknown = sorted({b for b in blocks if b not in SYMBOLS})
    if unknown:
        raise ConfigError(f"{source}: layers_block_type has {unknown}; mtl converts {sorted(SYMBOLS)}")
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
        **(moe_section(hf, source) if "moe" in blocks else {}),
    }


def moe_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``[model]`` MoE keys of a Nemotron-H config.json with ``moe`` layers."""
    if hf.get("moe_latent_size") is not None:
        raise ConfigError(f"{source}: moe_latent_size = {hf['moe_latent_size']}; mtl does not build the latent "
                          "projections around the experts (configs with moe_latent_size = null convert)")
    top_k, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group", 1), hf.get("topk_group", 1)
    if groups > 1 and top_k // group_topk != HF_GROUP_RANK:
        raise ConfigError(
            f"{source}: n_group = {groups}: HF ranks expert groups by their best {HF_GROUP_RANK} scores, mtl (as "
            f"Megatron) by num_experts_per_tok // topk_group = {top_k} // {group_topk}; they agree only where that is "
            f"{HF_GROUP_RANK}"
        )
    return {
        "num_experts": hf["n_routed_experts"],
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_shared_expert_ffn_hidden_size": hf["moe_shared_expert_intermediate_size"],
        "moe_router": "sigmoid",
        "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "moe_router_expert_bias": True,
        "moe_router_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "moe_router_num_groups": groups,
        "moe_router_group_topk": group_topk,
        "moe_aux_loss_coeff": 0.0,  # HF's model computes none
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
        elif symbol == "E":
            yield from moe_to_mtl(section, hf + "mixer.", ours + "mlp.", read)
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
        elif symbol == "E":
            yield from moe_from_mtl(m, hf + "mixer.", ours + "mlp.", read)
        else:
            yield hf + "mixer.up_proj.weight", read(ours + "mlp.linear_fc1.weight")
            yield hf + "mixer.down_proj.weight", read(ours + "mlp.linear_fc2.weight")
    yield PREFIX + "norm_f.weight", read("final_norm.weight")
    if not m.tie_embeddings:
        yield "lm_head.weight", read("output_layer.weight")


def moe_to_mtl(section: dict[str, Any], hf: str, ours: str, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield ours + "router.weight", read(hf + "gate.weight")
    yield ours + "router.expert_bias", read(hf + "gate.e_score_correction_bias")
    yield from experts_to_mtl(hf + "experts.", ours, section["num_experts"], EXPERT_NAMES, read)
    yield ours + "shared_experts.linear_fc1.weight", read(hf + "shared_experts.up_proj.weight")
    yield ours + "shared_experts.linear_fc2.weight", read(hf + "shared_experts.down_proj.weight")


def moe_from_mtl(m, hf: str, ours: str, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    yield hf + "gate.weight", read(ours + "router.weight").float()  # HF keeps the router in fp32
    # without model.moe_router_expert_bias the choice is unbiased: HF's zeros
    yield hf + "gate.e_score_correction_bias", (read(ours + "router.expert_bias").float() if m.moe_router_expert_bias
                                                else torch.zeros(m.num_experts, dtype=torch.float32))
    yield from experts_from_mtl(hf + "experts.", ours, m.num_experts, EXPERT_NAMES, read)
    yield hf + "shared_experts.up_proj.weight", read(ours + "shared_experts.linear_fc1.weight")
    yield hf + "shared_experts.down_proj.weight", read(ours + "shared_experts.linear_fc2.weight")


def check_moe_exportable(m) -> None:
    """What HF's NemotronHMoE computes: sigmoid routing, relu2 experts, one ungated shared expert,
    no capacity, groups ranked by their best two scores."""
    wrong = [(key, getattr(m, key), want) for key, want in (("moe_router", "sigmoid"), ("moe_capacity_factor", None),
                                                             ("moe_shared_expert_gate", False))
             if getattr(m, key) != want]
    if not m.moe_shared_expert_ffn_hidden_size:
        wrong.append(("moe_shared_expert_ffn_hidden_size", 0, "the shared expert's width (> 0)"))
    if m.moe_router_num_groups > 1 and m.moe_top_k // m.moe_router_group_topk != HF_GROUP_RANK:
        wrong.append(("moe_top_k // moe_router_group_topk", m.moe_top_k // m.moe_router_group_topk, HF_GROUP_RANK))
    if wrong:
        key, have, want = wrong[0]
        raise ConfigError(f"model.{key} = {have!r}: Nemotron-H's MoE layer needs {want!r}")


def check_nemotron_h_exportable(m) -> None:
    symbols = set(m.hybrid_pattern.replace("|", ""))
    if "E" in symbols:
        check_moe_exportable(m)
    if symbols & {"-", "E"} and m.activation != "relu2":
        raise ConfigError(f"model.activation = {m.activation!r}: Nemotron-H's MLP and experts are relu2")
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
        **(moe_config(m) if m.num_experts else {}),
        "dtype": str(dtype).removeprefix("torch."),
    }


def moe_config(m) -> dict[str, Any]:
    return {
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.moe_top_k,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_ffn_hidden_size,
        "n_shared_experts": 1,
        "moe_latent_size": None,
        "norm_topk_prob": m.moe_norm_topk_prob,
        "routed_scaling_factor": m.moe_router_scaling_factor,
        "n_group": m.moe_router_num_groups,
        "topk_group": m.moe_router_group_topk,
    }
