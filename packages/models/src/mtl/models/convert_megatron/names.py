"""Megatron-Core GPT tensor names <-> mtl global names.

Megatron-Core stores the transformer layers stacked along a prepended layer axis
(``decoder.layers.mlp.linear_fc2.weight`` is ``[num_layers, h, ffn]``, the global layer
number over every pipeline stage) when every layer is alike; when they differ (MoE in some
layers: ``moe_layer_freq`` > 1 or a list) or with ``singleton_local_shards``, one tensor per
layer (``decoder.layers.3.mlp.linear_fc2.weight``). Both are read.

Experts (``mlp.experts.experts.`` — the MoE layer's ``experts`` module holds an ``experts``
prefix of its own) are stored grouped, stacked along an expert axis after the layer axis
(``experts.linear_fc1.weight [L, E, 2 * ffn, h]``, whether SequentialMLP, TEGroupedMLP or the
legacy GroupedMLP wrote them), or per expert under ``singleton_local_shards``
(``experts.{e}.linear_fc1.weight``); a gated fc1 saved with singleton shards is split into its
gate and up halves, ``linear_fc1.weight_w`` and ``linear_fc1.weight_v``.

The layer norms have two spellings: the local spec's ``input_layernorm.weight`` /
``pre_mlp_layernorm.weight``, and Transformer Engine's fused ``self_attention.linear_qkv.
layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``. Megatron-Core's local spec saves
its norms under the TE names too (its ``sharded_state_dict_keys_map``), so a dense layer's
keys are the same in both specs; in an MoE layer the TE spec keeps a separate
``pre_mlp_layernorm`` while the local spec still maps it to ``mlp.linear_fc1.layer_norm_``.

Layouts that need no change: the fused QKV rows are group-major ``[g0: q heads, k, v][g1: ...]``
as ours, and a gated fc1 is stored ``[2 * ffn, h]`` as gate rows then up rows whatever the TP
degree (each rank's half-shards are placed at both offsets), i.e. our ``[2, ffn, h]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYERS = "decoder.layers."

# mtl per-layer name for each stored per-layer suffix (expert index and halves removed)
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
    "mlp.router.weight": "mlp.router.weight",
    "mlp.experts.linear_fc1.weight": "mlp.experts.linear_fc1.weight",
    "mlp.experts.linear_fc2.weight": "mlp.experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_experts_gate.weight",
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

# fc1 weights that hold gate and up rows when the MLP is gated: our [2, ffn, h]
FC1_NAMES = ("mlp.linear_fc1.weight", "mlp.experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")

# key fragment -> the feature it belongs to, which mtl's GPT does not have
UNSUPPORTED: dict[str, str] = {
    "router.expert_bias": "aux-loss-free expert bias (moe_router_enable_expert_bias)",
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
_EXPERT = re.compile(r"mlp\.experts\.(?:experts\.)?(?:(\d+)\.)?(.+)")
_HALF = re.compile(r"(.+\.(?:weight|bias))_([wv])")


@dataclass(frozen=True)
class StoredKey:
    """Where a stored tensor belongs: ``layer`` None means stacked over layers (axis 0) for a
    layer tensor; ``expert`` None means stacked over experts (the next axis) for an expert
    tensor; ``half`` 0/1: the gate/up half of a gated fc1 saved apart (``_w``/``_v``)."""

    key: str
    suffix: str
    layer: int | None = None
    expert: int | None = None
    half: int | None = None


def parse_layer_key(key: str) -> StoredKey | None:
    """A ``decoder.layers.`` key as (normalised suffix, layer, expert, half); None otherwise."""
    if not key.startswith(LAYERS):
        return None
    rest, layer, expert, half = key[len(LAYERS):], None, None, None
    match = _PER_LAYER.fullmatch(rest)
    if match:
        layer, rest = int(match[1]), match[2]
    match = _HALF.fullmatch(rest)
    if match:
        rest, half = match[1], "wv".index(match[2])
    match = _EXPERT.fullmatch(rest)
    if match:
        expert = int(match[1]) if match[1] is not None else None
        rest = "mlp.experts." + match[2]
    return StoredKey(key, rest, layer, expert, half)


def unsupported_feature(key: str) -> str | None:
    for fragment, feature in UNSUPPORTED.items():
        if fragment in key:
            return feature
    if ".experts." in key and (key.endswith(".bias") or ".bias" in key.rsplit(".", 1)[-1]):
        return "biases in the experts"
    return None


def is_model_key(key: str) -> bool:
    return not key.startswith(NOT_MODEL_PREFIXES) and "_extra_state" not in key
