"""mtl's resolved ``[model]`` config -> the Megatron-LM ``args`` an exported checkpoint carries
in ``common.pt`` (what ``--use-checkpoint-args`` and conversion tools read to rebuild the
model), with every feature Megatron-Core cannot express refused by name first.
"""

from __future__ import annotations

import argparse
from typing import Any

from mtl.core.errors import ConfigError

SPECS = ("local", "te")  # Megatron-Core's layer specs: the local one, Transformer Engine's

# Megatron-Core's Llama 3 RoPE scaling fixes these (only the factor is an argument)
_MEGATRON_ROPE_SCALING = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                              rope_original_max_position_embeddings=8192)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_exportable(m, tp: int, pp: int) -> None:
    """Refuse, in one line each, what a Megatron-Core GPTModel cannot load or compute alike."""
    if m.activation not in ("swiglu", "gelu"):
        raise ConfigError(f"model.activation = '{m.activation}': the export writes Megatron's SwiGLU or GELU MLPs "
                          "only; this model cannot be exported to Megatron")
    if m.position_embedding not in ("rope", "learned"):
        raise ConfigError(f"model.position_embedding = '{m.position_embedding}': the export writes rotary or "
                          "learned positions only; this model cannot be exported to Megatron")
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        raise ConfigError(f"--tp {tp}: Megatron splits the {m.num_attention_heads} heads and {m.num_query_groups} "
                          "query groups over TP; both must be divisible by it")
    if m.num_layers % pp:
        raise ConfigError(f"--pp {pp}: model.num_layers = {m.num_layers} is not divisible by it (Megatron's even split)")
    if m.rope_scaling == "llama3":
        for key, value in _MEGATRON_ROPE_SCALING.items():
            if getattr(m, key) != value:
                raise ConfigError(f"model.{key} = {getattr(m, key)}: Megatron-Core's Llama 3 RoPE scaling fixes it "
                                  f"at {value}; this model cannot be exported to Megatron")
    unmapped = {"moe_router_expert_bias": False, "moe_router_scaling_factor": 1.0, "moe_router_num_groups": 1}
    for key, off in unmapped.items():
        if m.num_experts and getattr(m, key) != off:
            raise ConfigError(f"model.{key} = {getattr(m, key)}: the Megatron export does not write this routing "
                              "yet; this model cannot be exported to Megatron")
    if m.num_experts and m.moe_router == "sigmoid" and m.moe_norm_topk_prob != (m.moe_top_k > 1):
        raise ConfigError(
            f"model.moe_norm_topk_prob = {str(m.moe_norm_topk_prob).lower()} with a sigmoid router and moe_top_k = "
            f"{m.moe_top_k}: Megatron renormalises sigmoid scores exactly when top_k > 1")


def megatron_args(m, *, tp: int, pp: int, spec: str, iteration: int, bf16: bool, fp16: bool) -> argparse.Namespace:
    """The ``argparse.Namespace`` Megatron-LM's ``pretrain_gpt.py`` would save for this model."""
    rope = m.position_embedding == "rope"
    args: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        group_query_attention=m.num_query_groups != m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        position_embedding_type="rope" if rope else "learned_absolute",
        use_rotary_position_embeddings=rope,
        add_position_embedding=not rope,
        rotary_base=int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=m.rope_scaling == "llama3",
        rope_scaling_factor=m.rope_scaling_factor,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=m.norm_eps,
        apply_layernorm_1p=False,
        swiglu=m.activation == "swiglu",
        squared_relu=False,
        openai_gelu=False,
        add_bias_linear=m.bias,
        add_qkv_bias=m.bias or m.qkv_bias,
        qk_layernorm=m.qk_norm,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_std,
        vocab_size=m.vocab_size,  # the true vocabulary (Megatron-LM's --vocab-size)
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        transformer_impl="transformer_engine" if spec == "te" else "local",
        ckpt_format="torch_dist",
        bf16=bf16,
        fp16=fp16,
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        num_experts=m.num_experts or None,
    )
    if m.num_experts:
        args.update(moe_args(m))
    return argparse.Namespace(**args)


def moe_args(m) -> dict[str, Any]:
    every_layer = list(m.moe_layers) == list(range(m.num_layers))
    return dict(
        moe_router_topk=m.moe_top_k,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        # a list (one 0/1 per layer) unless every layer is MoE
        moe_layer_freq=1 if every_layer else [int(i in m.moe_layers) for i in range(m.num_layers)],
        moe_router_score_function=m.moe_router,
        moe_router_pre_softmax=m.moe_router == "softmax" and not m.moe_norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_z_loss_coeff=m.moe_z_loss_coeff or None,
        moe_expert_capacity_factor=m.moe_capacity_factor,
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff else "none",
        moe_grouped_gemm=False,
    )
