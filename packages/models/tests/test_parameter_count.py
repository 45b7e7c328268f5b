"""Parameters per component of the gpt model built on the meta device (what ``--dry-run``
prints) equal a hand count from the config, and the model built for real."""

import pytest
import torch

from mtl.core.flops import parameter_counts
from mtl.models.gpt import build_gpt

COMPONENTS = ("embedding", "layers", "final_norm", "output_layer")


def hand_count(cfg) -> dict[str, int]:
    """Parameters per component of a GPT-style model from its config (padded vocabulary rows
    included, as the model stores them)."""
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
    return {
        "embedding": m.padded_vocab_size * h
        + (m.max_position_embeddings * h if m.position_embedding == "learned" else 0),
        "layers": m.num_layers * (attn + mlp + 2 * norm),
        "final_norm": norm,
        "output_layer": 0 if m.tie_embeddings else m.padded_vocab_size * h,
    }


@pytest.mark.parametrize("style,qk_norm", [("gpt2", False), ("gpt2", True), ("llama", True), ("llama", False)])
def test_parameter_count_per_component(make_config, backend, single, style, qk_norm):
    config = make_config(style, model={"qk_norm": qk_norm})
    with torch.device("meta"):
        meta = build_gpt(config, single, backend)
    counts = parameter_counts(meta)
    expected = hand_count(config)
    assert {k: counts[k] for k in COMPONENTS} == expected
    assert counts["total"] == sum(expected.values())
    built = build_gpt(config, single, backend)
    assert counts["total"] == sum(p.numel() for p in built.parameters())  # a tied weight is listed once
