"""The ``gpt`` family's FLOP and activation-memory counts, Megatron's formulas so numbers compare.

Family-independent arithmetic (parameter counts of a built model, weight/gradient/optimizer
bytes) is in ``mtl.core.flops``; only what depends on this layer's shape is here.
"""

from __future__ import annotations

from mtl.core.config import RunConfig


def flops_per_iteration(cfg: RunConfig) -> float:
    """Model FLOPs of one training iteration (forward + backward, no recompute), Megatron's formula.

    Per layer and token: attention projections, attention scores, MLP; plus the LM head.
    The leading factor 3 counts forward (1) and backward (2); 2 FLOPs per multiply-add.
    A parallel attention + MLP block (GPT-J) has the same GEMMs and counts the same; an MoE
    layer counts its active parameters."""
    m, t = cfg.model, cfg.train
    assert cfg.resolved, "resolve the config first"
    logits = 2 * m.hidden_size * m.padded_vocab_size
    return sum(layer_flops_per_iteration(cfg)) + 3.0 * t.global_batch_size * m.seq_length * logits


def layer_flops_per_iteration(cfg: RunConfig) -> list[float]:
    """Each transformer layer's share of ``flops_per_iteration``, in layer order (the rest is
    the LM head's): what a pipeline stage holding those layers computes."""
    m, t = cfg.model, cfg.train
    assert cfg.resolved, "resolve the config first"
    tokens = t.global_batch_size * m.seq_length
    attention, dense_mlp = attention_flops_per_token(m), dense_mlp_flops_per_token(m)
    moe_mlp = moe_mlp_flops_per_token(m) if m.moe_layers else 0
    moe_layers = set(m.moe_layers or [])
    return [3.0 * tokens * (attention + (moe_mlp if i in moe_layers else dense_mlp)) for i in range(m.num_layers)]


def attention_flops_per_token(m) -> float:
    """Forward FLOPs of one attention block per token (``m``: the resolved model section)."""
    h, s = m.hidden_size, m.seq_length
    q_width = m.num_attention_heads * m.head_dim
    kv_width = m.num_query_groups * m.head_dim
    return (
        2 * h * (q_width + 2 * kv_width)  # QKV projection
        + 2 * q_width * s  # QK^T and attention-weighted V: 4*q*s, halved for the causal mask
        + 2 * q_width * h  # output projection
    )


def dense_mlp_flops_per_token(m) -> float:
    """Forward FLOPs of the dense MLP per token: in (gated: two matrices) and out."""
    gated = 2 if m.activation == "swiglu" else 1
    return 2 * m.hidden_size * m.ffn_hidden_size * (gated + 1)


def moe_mlp_flops_per_token(m) -> float:
    """An MoE layer counts the FLOPs of its active parameters (Megatron's convention): the
    router, the top-k experts each token goes to, and the shared expert."""
    h, gated = m.hidden_size, 2 if m.activation == "swiglu" else 1
    return (2 * h * m.num_experts
            + m.moe_top_k * 2 * h * m.moe_ffn_hidden_size * (gated + 1)
            + 2 * h * m.moe_shared_expert_ffn_hidden_size * (gated + 1))


def activation_bytes_per_layer(cfg: RunConfig) -> float:
    """Activations one layer keeps for backward, one micro-batch on one rank, in units of s*b*h
    16-bit values (doubled in fp32). Megatron's count (Korthikanti et al., 34*s*b*h/tp with
    sequence parallelism, plus 5*a*s/h*s*b*h/tp of attention scores) item by item, as mtl's
    layers keep them: no s x s scores, softmax or attention-dropout mask (every attention kernel
    mtl runs, SDPA's flash / cuDNN / memory-efficient, FA4 and Transformer Engine's fused one,
    keeps only q, k, v, the output and a per-row log-sum-exp: on 4 H200s the s x s term made
    the 8B row's estimate 3.4x its measured peak), k and v at the grouped-query width, the MLP at
    its own width (SwiGLU's fc1 output is two ffn-wide halves), and the two 1-byte
    hidden-dropout masks only under ``model.hidden_dropout``. Without sequence parallelism the
    norms' inputs and outputs and the masks are whole on every TP rank. Full recompute keeps
    only the layer's input, 2*s*b*h/tp."""
    m = cfg.model
    split = attention_bytes_per_unit(m) + mlp_bytes_per_unit(m, m.ffn_hidden_size)
    return layer_activation_bytes(cfg, norms=2, split=split)


def attention_bytes_per_unit(m) -> float:
    """16-bit bytes per token and hidden unit attention keeps: q, then k and v at the grouped-query
    width; the attention output."""
    kv = m.num_query_groups / m.num_attention_heads
    return 2 + 4 * kv + 2


def mlp_bytes_per_unit(m, ffn_hidden_size: int) -> float:
    """16-bit bytes per token and hidden unit an MLP of ``ffn_hidden_size`` keeps: fc1's output
    (SwiGLU's two halves) and the activation's (fc2's input)."""
    ffn, gated = ffn_hidden_size / m.hidden_size, 2 if m.activation == "swiglu" else 1
    return 2 * gated * ffn + 2 * ffn


def layer_activation_bytes(cfg: RunConfig, *, norms: int, split: float) -> float:
    """A layer of ``norms`` residual branches (each a norm's input and output, 2 + 2 bytes, and a
    1-byte dropout mask under ``model.hidden_dropout``) and ``split`` bytes per token and hidden
    unit that TP divides, for one micro-batch on one rank (see ``activation_bytes_per_layer``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    s, b, h = m.seq_length // p.cp, t.micro_batch_size, m.hidden_size
    whole = norms * (2 + 2 + (1 if m.hidden_dropout > 0 else 0))
    per_layer = s * b * h * ((whole + split) / p.tp if p.sequence_parallel else whole + split / p.tp)
    if t.recompute == "full":
        per_layer = 2 * s * b * h / p.tp
    return per_layer * (2 if t.precision == "fp32" else 1)
