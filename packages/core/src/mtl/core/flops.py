"""FLOP and memory estimates, counted the way Megatron-LM counts them so numbers compare."""

from __future__ import annotations

from mtl.core.config import RunConfig


def flops_per_iteration(cfg: RunConfig) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recompute), Megatron's formula.

    Per layer and token: attention projections, attention scores, MLP; plus the LM head.
    The leading factor 3 counts forward (1) and backward (2); 2 FLOPs per multiply-add."""
    m, t = cfg.model, cfg.train
    assert cfg.resolved, "resolve the config first"
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    tokens = t.global_batch_size * s
    q_width = m.num_attention_heads * m.head_dim
    kv_width = m.num_query_groups * m.head_dim
    gated = 2 if m.activation == "swiglu" else 1
    per_token_layer = (
        2 * h * (q_width + 2 * kv_width)  # QKV projection
        + 2 * q_width * s  # QK^T and attention-weighted V: 4*q*s, halved for the causal mask
        + 2 * q_width * h  # output projection
        + 2 * h * m.ffn_hidden_size * (gated + 1)  # MLP in (gated: two) and out
    )
    logits = 2 * h * m.padded_vocab_size
    return 3.0 * tokens * (L * per_token_layer + logits)


def parameter_count(cfg: RunConfig) -> dict[str, int]:
    """Parameters per component of a GPT-family model (the whole model, not one rank's share)."""
    m = cfg.model
    h = m.hidden_size
    q_width = m.num_attention_heads * m.head_dim
    kv_width = m.num_query_groups * m.head_dim
    norm = h * (2 if m.normalization == "layernorm" else 1)
    bias = 1 if m.bias else 0
    gated = 2 if m.activation == "swiglu" else 1
    attn = h * (q_width + 2 * kv_width) + q_width * h + bias * (q_width + 2 * kv_width + h)
    if m.qk_norm:
        attn += 2 * m.head_dim * (2 if m.normalization == "layernorm" else 1)
    mlp = h * m.ffn_hidden_size * (gated + 1) + bias * (m.ffn_hidden_size * gated + h)
    counts = {
        "embedding": m.padded_vocab_size * h
        + (m.max_position_embeddings * h if m.position_embedding == "learned" else 0),
        "layers": m.num_layers * (attn + mlp + 2 * norm),
        "final_norm": norm,
        "output_layer": 0 if m.tie_embeddings else m.padded_vocab_size * h,
    }
    counts["total"] = sum(counts.values())
    return counts


def memory_per_gpu_bytes(cfg: RunConfig) -> dict[str, float]:
    """A coarse estimate: weights, gradients, Adam state (sharded with the distributed optimizer),
    and activations of one micro-batch per in-flight pipeline stage (Megatron's per-layer
    activation formula for no recompute: s*b*h*(34 + 5*a*s/h) bytes, divided by tp)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    params = parameter_count(cfg)["total"] / (p.tp * p.pp)
    bytes_weights = params * (2 + 4 if t.precision != "fp32" else 4)  # bf16 copy + fp32 master
    bytes_grads = params * 4
    adam = params * 8 / (p.dp if p.distributed_optimizer else 1)
    s, b, h, a = m.seq_length // p.cp, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    act_per_layer = s * b * h * (34 + 5 * a * s / h) / p.tp
    if t.recompute == "full":
        act_per_layer = 2 * s * b * h / p.tp
    layers_here = m.num_layers / p.pp
    in_flight = p.pp  # 1F1B keeps up to pp micro-batches alive on the first stage
    activations = act_per_layer * layers_here * in_flight
    if t.precision == "fp32":
        activations *= 2
    return {
        "weights": bytes_weights,
        "grads": bytes_grads,
        "optimizer": adam,
        "activations": activations,
        "total": bytes_weights + bytes_grads + adam + activations,
    }
