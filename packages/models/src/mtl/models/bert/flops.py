"""The ``bert`` family's FLOP count: gpt's layer formula (the same GEMMs) with attention scores
over every key rather than the causal half, and the MLM head's transform before the decoder
(or the classifier)."""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.models.gpt import flops as gpt_flops


def layer_flops_per_iteration(cfg: RunConfig) -> list[float]:
    m, t = cfg.model, cfg.train
    tokens = t.global_batch_size * m.seq_length
    # gpt halves QK^T and the weighted V for its causal mask; a bidirectional layer does all of it
    unmasked_half = 3.0 * tokens * 2 * m.num_attention_heads * m.head_dim * m.seq_length
    return [flops + unmasked_half for flops in gpt_flops.layer_flops_per_iteration(cfg)]


def flops_per_iteration(cfg: RunConfig) -> float:
    """Layers, the MLM transform (dense h x h) and the decoder over the vocabulary, forward and
    backward; with ``model.num_labels`` the pooler and classifier on each sample's first token instead."""
    m, t = cfg.model, cfg.train
    if m.num_labels:
        classifier = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * m.num_labels
        return sum(layer_flops_per_iteration(cfg)) + 3.0 * t.global_batch_size * classifier
    head = 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * m.padded_vocab_size
    return sum(layer_flops_per_iteration(cfg)) + 3.0 * t.global_batch_size * m.seq_length * head
