"""The ``t5`` family's FLOP count, Megatron's way (3 x forward GEMMs, 2 FLOPs per multiply-add):
encoder layers over the encoder tokens, decoder layers (self- and cross-attention) over the
decoder tokens, and the LM head over the decoder tokens."""

from __future__ import annotations

from mtl.core.config import RunConfig


def layer_flops_per_iteration(cfg: RunConfig) -> list[float]:
    """Encoder layers, then decoder layers, in model order."""
    m, t = cfg.model, cfg.train
    h, width, s_enc, s_dec = m.hidden_size, m.num_attention_heads * m.head_dim, m.seq_length, cfg.data.decoder_seq_length
    mlp = 2 * h * m.ffn_hidden_size * (3 if m.activation == "gated-gelu" else 2)
    projections = 2 * h * 4 * width  # q, k, v, output
    encoder = projections + 4 * width * s_enc + mlp  # scores and weighted values over every key
    # decoder: causal self-attention (half the score work), cross-attention (q, output; k/v from the
    # encoder's s_enc tokens, counted per decoder token) over the encoder's keys
    cross = 2 * h * 2 * width + 2 * h * 2 * width * s_enc / s_dec + 4 * width * s_enc
    decoder = projections + 2 * width * s_dec + cross + mlp
    b = t.global_batch_size
    return [3.0 * b * s_enc * encoder] * m.num_layers + [3.0 * b * s_dec * decoder] * m.num_decoder_layers


def flops_per_iteration(cfg: RunConfig) -> float:
    m = cfg.model
    head = 2 * m.hidden_size * m.padded_vocab_size
    return sum(layer_flops_per_iteration(cfg)) + 3.0 * cfg.train.global_batch_size * cfg.data.decoder_seq_length * head
