"""Megatron-Core GPT tensor names -> mtl global names.

Megatron-Core stores the transformer layers stacked along a prepended layer axis
(``decoder.layers.mlp.linear_fc2.weight`` is ``[num_layers, h, ffn]``, the global layer
number over every pipeline stage); older or hand-written checkpoints may hold one tensor per
layer (``decoder.layers.3.mlp.linear_fc2.weight``). Both are read.

The layer norms have two spellings: the local spec's ``input_layernorm.weight`` /
``pre_mlp_layernorm.weight``, and Transformer Engine's fused ``self_attention.linear_qkv.
layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight`` (Megatron-Core also saves the
local spec under the TE names, so that either loads into the other).

Layouts that need no change: the fused QKV rows are group-major ``[g0: q heads, k, v][g1: ...]``
as ours, and a gated fc1 is stored ``[2 * ffn, h]`` as gate rows then up rows whatever the TP
degree (each rank's half-shards are placed at both offsets), i.e. our ``[2, ffn, h]``.
"""

from __future__ import annotations

import re

LAYERS = "decoder.layers."

# mtl per-layer name for each stored per-layer suffix
LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "input_norm.weight",
    "input_layernorm.bias": "input_norm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_norm.bias",
    "pre_mlp_layernorm.weight": "pre_mlp_norm.weight",
    "pre_mlp_layernorm.bias": "pre_mlp_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_norm.bias",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight": "self_attention.q_norm.weight",
    "self_attention.q_layernorm.bias": "self_attention.q_norm.bias",
    "self_attention.k_layernorm.weight": "self_attention.k_norm.weight",
    "self_attention.k_layernorm.bias": "self_attention.k_norm.bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias": "self_attention.linear_proj.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}

TOP_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output_layer.weight",
}

# tensors of the vocabulary whose rows Megatron pads
VOCAB_TABLES = ("embedding.word_embeddings.weight", "output_layer.weight")

# key fragment -> the feature it belongs to, which mtl's GPT does not have
UNSUPPORTED: dict[str, str] = {
    ".experts.": "mixture of experts (MoE)",
    ".router.": "mixture of experts (MoE)",
    "shared_experts": "mixture of experts (MoE)",
    "linear_q_down_proj": "multi-latent attention (MLA)",
    "linear_kv_down_proj": "multi-latent attention (MLA)",
    "linear_q_proj": "multi-latent attention (MLA)",
    "kv_layernorm": "multi-latent attention (MLA)",
    "mtp.": "multi-token prediction (MTP)",
    "mixer.": "Mamba (hybrid) layers",
}

# stored tensors that are not model weights (a training checkpoint keeps its optimizer here)
NOT_MODEL_PREFIXES = ("optimizer.",)

_PER_LAYER = re.compile(r"(\d+)\.(.+)")


def split_layer_key(key: str) -> tuple[int | None, str] | None:
    """``decoder.layers.<suffix>`` -> (None, suffix) for a stacked tensor, ``decoder.layers.
    <i>.<suffix>`` -> (i, suffix) for one layer's; None for a key outside the layers."""
    if not key.startswith(LAYERS):
        return None
    rest = key[len(LAYERS):]
    match = _PER_LAYER.fullmatch(rest)
    if match:
        return int(match[1]), match[2]
    return None, rest


def unsupported_feature(key: str) -> str | None:
    for fragment, feature in UNSUPPORTED.items():
        if fragment in key:
            return feature
    return None


def is_model_key(key: str) -> bool:
    return not key.startswith(NOT_MODEL_PREFIXES) and not key.endswith("_extra_state")
