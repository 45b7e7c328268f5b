"""The hybrid family's FLOP counts: each layer by its symbol, Megatron's formulas (its hybrid
model's Mamba-layer count: in-projection, 7·d_inner·N for the scan, out-projection; gpt's for
attention, MLP and MoE) so numbers compare; the LM head as gpt counts it."""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.core.config_hybrid import layer_symbols
from mtl.models.gpt.flops import attention_flops_per_token, dense_mlp_flops_per_token, moe_mlp_flops_per_token


def mamba_flops_per_token(m) -> float:
    """Forward FLOPs of one Mamba-2 mixer per token (``m``: the resolved model section)."""
    h, inner = m.hidden_size, m.mamba_num_heads * m.mamba_head_dim
    in_width = 2 * inner + 2 * m.mamba_num_groups * m.mamba_state_dim + m.mamba_num_heads
    return 2 * h * in_width + 7 * inner * m.mamba_state_dim + 2 * inner * h


def layer_flops_per_iteration(cfg: RunConfig) -> list[float]:
    """Each layer's forward + backward FLOPs of one iteration, in layer order."""
    m, t = cfg.model, cfg.train
    assert cfg.resolved, "resolve the config first"
    per_token = {"M": mamba_flops_per_token(m), "*": attention_flops_per_token(m), "-": dense_mlp_flops_per_token(m)}
    if m.num_experts:
        per_token["E"] = moe_mlp_flops_per_token(m)
    tokens = t.global_batch_size * m.seq_length
    return [3.0 * tokens * per_token[symbol] for symbol in layer_symbols(m.hybrid_pattern)]


def flops_per_iteration(cfg: RunConfig) -> float:
    """Model FLOPs of one training iteration: the layers and the LM head (forward + backward)."""
    m, t = cfg.model, cfg.train
    head = 3.0 * t.global_batch_size * m.seq_length * 2 * m.hidden_size * m.padded_vocab_size
    return sum(layer_flops_per_iteration(cfg)) + head
