"""The mtl ``[model]`` section of a Megatron-Core GPT checkpoint.

Sizes come from the stored shapes (they cannot be wrong); the rest from Megatron-LM's
``args`` in ``common.pt`` when the checkpoint has them, else from the caller's options
(a bare ``dist_checkpointing.save`` records no hyper-parameters). An explicit option wins
over ``args``. Features mtl's GPT does not have are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtl.core.errors import ConfigError

# options of ``MegatronConverter.to_mtl`` (mtl [model] key names) that fill in for ``args``
OPTIONS = (
    "num_attention_heads",
    "num_query_groups",
    "normalization",
    "norm_eps",
    "activation",
    "position_embedding",
    "rope_theta",
    "seq_length",
    "max_position_embeddings",
    "moe_top_k",
    "moe_router",
    "moe_norm_topk_prob",
)

_NORMALIZATION = {"rmsnorm": "rmsnorm", "layernorm": "layernorm"}  # lower-cased Megatron or mtl spelling
_POSITION = {"rope": "rope", "learned_absolute": "learned", "learned": "learned"}

# Megatron-LM args whose non-default value is a feature mtl's GPT lacks: (arg, default, feature)
_REFUSED_ARGS = (
    # built in mtl's MoE layer (Nemotron-H's converter uses them), not read from Megatron's args yet
    ("moe_router_enable_expert_bias", False, "aux-loss-free expert bias (moe_router_enable_expert_bias)"),
    ("moe_router_num_groups", None, "group-limited routing (moe_router_num_groups)"),
    ("moe_latent_size", None, "latent MoE (moe_latent_size)"),
    ("multi_latent_attention", False, "multi-latent attention (MLA)"),
    ("mtp_num_layers", None, "multi-token prediction (MTP)"),
    ("apply_layernorm_1p", False, "zero-centred gamma (apply_layernorm_1p)"),
    ("squared_relu", False, "squared ReLU activation"),
    ("openai_gelu", False, "tanh-approximated GELU (openai_gelu)"),
    ("rotary_interleaved", False, "interleaved RoPE (rotary_interleaved)"),
    ("hybrid_override_pattern", None, "Mamba hybrid layers"),
    ("qk_l2_norm", False, "L2 query/key norm (qk_l2_norm)"),
)


@dataclass
class StoredShapes:
    """What the tensors' shapes say about the model."""

    num_layers: int
    hidden_size: int
    vocab_rows: int  # Megatron's padded vocabulary
    qkv_rows: int  # groups * (q_per_group + 2) * head_dim
    ffn_hidden_size: int | None  # of the dense MLPs (None: every layer is MoE)
    gated: bool  # fc1 has 2 * ffn rows (gate and up)
    learned_positions: int | None  # rows of embedding.position_embeddings, if stored
    bias: bool  # linear_proj has a bias
    qkv_bias: bool
    qk_norm: bool
    tied: bool  # no output_layer.weight stored
    moe_layers: list[int]  # layers with a router
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None
    shared_ffn_hidden_size: int = 0
    shared_gate: bool = False


def model_section(args: Any, shapes: StoredShapes, options: dict[str, Any], source: str) -> dict[str, Any]:
    """Our ``[model]`` keys (true ``vocab_size`` left to the caller)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown Megatron conversion options {unknown}; known: {', '.join(OPTIONS)}")
    if args is not None:
        _refuse_features(args, source)
    values = _from_args(args, shapes) if args is not None else {}
    values.update({k: v for k, v in options.items() if v is not None})

    required = ["num_attention_heads", "num_query_groups", "normalization", "norm_eps", "activation", "position_embedding"]
    if values.get("position_embedding") == "rope":
        required.append("rope_theta")
    if shapes.num_experts:
        required += ["moe_top_k", "moe_router", "moe_norm_topk_prob"]
    missing = [k for k in required if values.get(k) is None]
    if missing:
        raise ConfigError(
            f"{source} records no Megatron-LM args (a bare dist_checkpointing.save), so the converter "
            f"needs: {', '.join(missing)} (keyword options of MegatronConverter.to_mtl). "
            "Sizes (layers, hidden, ffn, vocabulary rows, QKV rows) are read from the shapes."
        )
    normalization = _choice("normalization", values["normalization"], _NORMALIZATION)
    position = _choice("position_embedding", values["position_embedding"], _POSITION)
    activation = str(values["activation"]).lower()
    if activation not in ("swiglu", "gelu"):
        raise ConfigError(f"activation = {activation!r}: mtl converts swiglu or gelu Megatron MLPs")
    if (activation == "swiglu") != shapes.gated:
        raise ConfigError(
            f"{source}: activation = {activation} but mlp.linear_fc1 stores "
            f"{'2 * ' if shapes.gated else ''}ffn_hidden_size rows ({'gated' if shapes.gated else 'not gated'}); "
            "pass the activation the model was trained with"
        )

    heads, groups = int(values["num_attention_heads"]), int(values["num_query_groups"])
    if heads % groups or shapes.qkv_rows % (heads + 2 * groups):
        raise ConfigError(
            f"{source}: linear_qkv has {shapes.qkv_rows} rows, which no head_dim gives with "
            f"num_attention_heads = {heads} and num_query_groups = {groups}; check those two"
        )
    head_dim = shapes.qkv_rows // (heads + 2 * groups)
    if values.get("head_dim") not in (None, head_dim):
        raise ConfigError(f"{source}: args.kv_channels = {values['head_dim']} but linear_qkv's rows give {head_dim}")
    if position == "learned" and shapes.learned_positions is None:
        raise ConfigError(f"{source}: learned positions, but embedding.position_embeddings.weight is not stored")
    if position == "rope" and shapes.learned_positions is not None:
        raise ConfigError(f"{source}: rope, yet embedding.position_embeddings.weight is stored; pass position_embedding=learned")

    section: dict[str, Any] = {
        "family": "gpt",
        "num_layers": shapes.num_layers,
        "hidden_size": shapes.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "head_dim": head_dim,
        "ffn_hidden_size": shapes.ffn_hidden_size or values.get("ffn_hidden_size") or shapes.moe_ffn_hidden_size,
        "normalization": normalization,
        "norm_eps": float(values["norm_eps"]),
        "activation": activation,
        "position_embedding": position,
        "bias": shapes.bias,
        "qkv_bias": shapes.qkv_bias and not shapes.bias,
        "tie_embeddings": shapes.tied,
        "qk_norm": shapes.qk_norm,
    }
    if position == "rope":
        section["rope_theta"] = float(values["rope_theta"])
        if values.get("rope_scaling_factor") is not None:
            section["rope_scaling"] = "llama3"
            section["rope_scaling_factor"] = float(values["rope_scaling_factor"])
    if shapes.num_experts:
        section.update(_moe_section(values, shapes, source))
    max_positions = shapes.learned_positions or values.get("max_position_embeddings")
    if max_positions:
        section["max_position_embeddings"] = int(max_positions)
    if values.get("seq_length"):
        section["seq_length"] = int(values["seq_length"])
    return section


def _from_args(args: Any, shapes: StoredShapes) -> dict[str, Any]:
    """Megatron-LM argument names -> ours (only what the shapes do not already say)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    heads = get("num_attention_heads")
    gqa = get("group_query_attention", False)
    values = {
        "num_attention_heads": heads,
        "num_query_groups": get("num_query_groups") if gqa else heads,
        "head_dim": get("kv_channels"),
        "normalization": get("normalization", "LayerNorm"),
        "norm_eps": get("norm_epsilon", 1e-5),
        "activation": "swiglu" if get("swiglu", False) else "gelu",
        "position_embedding": get("position_embedding_type", "learned_absolute"),
        "rope_theta": get("rotary_base", 10000),
        "seq_length": get("seq_length"),
        "max_position_embeddings": get("max_position_embeddings"),
    }
    if get("num_experts"):
        values.update(_moe_from_args(args))
    if get("use_rope_scaling", False):
        values["rope_scaling_factor"] = get("rope_scaling_factor", 8.0)
    return values


def _moe_from_args(args: Any) -> dict[str, Any]:
    """Megatron-LM's router arguments -> ours. Softmax routing takes the top k of the logits
    and a softmax over those k unless ``moe_router_pre_softmax`` (softmax over every expert,
    the top k kept as they are): our ``moe_norm_topk_prob`` true / false. Sigmoid scores are
    renormalised over the k chosen when k > 1."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    router, top_k = get("moe_router_score_function", "softmax"), get("moe_router_topk", 2)
    norm = not get("moe_router_pre_softmax", False) if router == "softmax" else top_k > 1
    aux = get("moe_aux_loss_coeff", 0.0)
    return {
        "ffn_hidden_size": get("ffn_hidden_size"),
        "moe_top_k": top_k,
        "moe_router": router,
        "moe_norm_topk_prob": norm,
        "moe_aux_loss_coeff": float(aux[0] if isinstance(aux, (list, tuple)) else aux or 0.0),
        "moe_z_loss_coeff": float(get("moe_z_loss_coeff") or 0.0),
        "moe_capacity_factor": get("moe_expert_capacity_factor"),
    }


def _moe_section(values: dict[str, Any], shapes: StoredShapes, source: str) -> dict[str, Any]:
    router = _choice("moe_router", values["moe_router"], {"softmax": "softmax", "sigmoid": "sigmoid"})
    top_k = int(values["moe_top_k"])
    if not 1 <= top_k <= shapes.num_experts:
        raise ConfigError(f"{source}: moe_top_k = {top_k} but the checkpoint has {shapes.num_experts} experts")
    section = {
        "num_experts": shapes.num_experts,
        "moe_top_k": top_k,
        "moe_router": router,
        "moe_norm_topk_prob": bool(values["moe_norm_topk_prob"]),
        "moe_ffn_hidden_size": shapes.moe_ffn_hidden_size,
        "moe_layers": list(shapes.moe_layers),
        "moe_shared_expert_ffn_hidden_size": shapes.shared_ffn_hidden_size,
        "moe_shared_expert_gate": shapes.shared_gate,
    }
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor"):
        if values.get(key) is not None:
            section[key] = values[key]
    return section


def _refuse_features(args: Any, source: str) -> None:
    for name, default, feature in _REFUSED_ARGS:
        value = getattr(args, name, default)
        if value not in (default, None, False, 0):
            raise ConfigError(f"{source}: args.{name} = {value!r}: {feature} is not converted from Megatron by mtl")
    scaling = getattr(args, "moe_router_topk_scaling_factor", None)
    if scaling not in (None, 1.0):
        raise ConfigError(f"{source}: args.moe_router_topk_scaling_factor = {scaling}: scaled routing weights are not "
                          "converted from Megatron by mtl")
    percent = getattr(args, "rotary_percent", 1.0)
    if percent != 1.0:
        raise ConfigError(f"{source}: args.rotary_percent = {percent}: partial RoPE is not supported by mtl's GPT")


def _choice(key: str, value: Any, allowed: dict[str, str]) -> str:
    choice = allowed.get(str(value).lower())
    if choice is None:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(sorted(set(allowed)))}")
    return choice
