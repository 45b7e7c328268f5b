"""Hugging Face ``T5ForConditionalGeneration`` (T5 1.0: ReLU, tied head; T5 1.1 / Flan-T5:
gated GELU, untied head) <-> mtl's ``T5Model`` tensors.

HF's separate q/k/v become gpt's group-major fused QKV (a group is one head); the
cross-attention's k/v become ``linear_kv`` with ``[k | v]`` per head; the gated MLP's
``wi_0``/``wi_1`` become fc1 ``[2, ffn, h]`` as gpt's SwiGLU. Each stack's relative position
bias (kept by HF in its first block) is the stack's ``relative_position_bias.weight``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from mtl.core.errors import ConfigError
from mtl.models.convert_hf.common import Read, fuse_qkv, split_qkv
from mtl.models.t5.model import T5Shape

FEED_FORWARD = {"relu": "relu", "gated-gelu": "gated-gelu"}  # HF's feed_forward_proj -> ours


def t5_shape(hf: dict[str, Any], source: str, padded_vocab_size: int | None = None) -> T5Shape:
    projection = hf.get("feed_forward_proj", "relu")
    if projection not in FEED_FORWARD:
        raise ConfigError(f"{source}: feed_forward_proj = {projection!r} is not supported (use one of {', '.join(FEED_FORWARD)})")
    return T5Shape(
        vocab_size=hf["vocab_size"], padded_vocab_size=padded_vocab_size or hf["vocab_size"], hidden_size=hf["d_model"],
        num_layers=hf["num_layers"], num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        num_attention_heads=hf["num_heads"], head_dim=hf["d_kv"], ffn_hidden_size=hf["d_ff"], activation=projection,
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), tie_embeddings=_tied(hf),
    )


def _tied(hf: dict[str, Any]) -> bool:
    """T5 1.0 ties its head and rescales the decoder output; 1.1 does neither. transformers 5
    records that as ``scale_decoder_outputs`` (its ``tie_word_embeddings`` is then always true);
    config.json files written before it as ``tie_word_embeddings``."""
    return bool(hf["scale_decoder_outputs"]) if "scale_decoder_outputs" in hf else hf.get("tie_word_embeddings", True)


def _attention(read: Read, hf: str, heads: int) -> torch.Tensor:
    return fuse_qkv(read(hf + "q.weight"), read(hf + "k.weight"), read(hf + "v.weight"), num_groups=heads)


def _kv(read: Read, hf: str, shape: T5Shape) -> torch.Tensor:
    k, v = (read(hf + f"{part}.weight").view(shape.num_attention_heads, shape.head_dim, -1) for part in ("k", "v"))
    return torch.stack([k, v], dim=1).reshape(2 * shape.num_attention_heads * shape.head_dim, -1)


def _mlp(read: Read, hf: str, ours: str, shape: T5Shape) -> Iterator[tuple[str, torch.Tensor]]:
    if shape.activation == "gated-gelu":
        yield ours + "mlp.linear_fc1.weight", torch.stack([read(hf + "wi_0.weight"), read(hf + "wi_1.weight")])
    else:
        yield ours + "mlp.linear_fc1.weight", read(hf + "wi.weight")
    yield ours + "mlp.linear_fc2.weight", read(hf + "wo.weight")


def t5_to_mtl(shape: T5Shape, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    heads = shape.num_attention_heads
    yield "embedding.word_embeddings.weight", read("shared.weight")
    for stack, count in (("encoder", shape.num_layers), ("decoder", shape.num_decoder_layers)):
        yield (f"{stack}.relative_position_bias.weight",
               read(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        for i in range(count):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            yield ours + "input_norm.weight", read(hf + "0.layer_norm.weight")
            yield ours + "self_attention.linear_qkv.weight", _attention(read, hf + "0.SelfAttention.", heads)
            yield ours + "self_attention.linear_proj.weight", read(hf + "0.SelfAttention.o.weight")
            mlp = 1
            if stack == "decoder":
                mlp = 2
                yield ours + "pre_cross_attention_norm.weight", read(hf + "1.layer_norm.weight")
                yield ours + "cross_attention.linear_q.weight", read(hf + "1.EncDecAttention.q.weight")
                yield ours + "cross_attention.linear_kv.weight", _kv(read, hf + "1.EncDecAttention.", shape)
                yield ours + "cross_attention.linear_proj.weight", read(hf + "1.EncDecAttention.o.weight")
            yield ours + "pre_mlp_norm.weight", read(hf + f"{mlp}.layer_norm.weight")
            yield from _mlp(read, hf + f"{mlp}.DenseReluDense.", ours, shape)
        yield f"{stack}.final_norm.weight", read(f"{stack}.final_layer_norm.weight")
    if not shape.tie_embeddings:
        yield "output_layer.weight", read("lm_head.weight")


def t5_from_mtl(shape: T5Shape, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """HF's tensors from ours (the inverse of ``t5_to_mtl``)."""
    heads, d = shape.num_attention_heads, shape.head_dim
    yield "shared.weight", read("embedding.word_embeddings.weight")
    for stack, count in (("encoder", shape.num_layers), ("decoder", shape.num_decoder_layers)):
        yield (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
               read(f"{stack}.relative_position_bias.weight"))
        for i in range(count):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            yield hf + "0.layer_norm.weight", read(ours + "input_norm.weight")
            q, k, v = split_qkv(read(ours + "self_attention.linear_qkv.weight"), heads, heads, d)
            for part, tensor in (("q", q), ("k", k), ("v", v)):
                yield hf + f"0.SelfAttention.{part}.weight", tensor.contiguous()
            yield hf + "0.SelfAttention.o.weight", read(ours + "self_attention.linear_proj.weight")
            mlp = 1
            if stack == "decoder":
                mlp = 2
                yield hf + "1.layer_norm.weight", read(ours + "pre_cross_attention_norm.weight")
                yield hf + "1.EncDecAttention.q.weight", read(ours + "cross_attention.linear_q.weight")
                kv = read(ours + "cross_attention.linear_kv.weight").view(heads, 2, d, -1)
                yield hf + "1.EncDecAttention.k.weight", kv[:, 0].reshape(heads * d, -1).contiguous()
                yield hf + "1.EncDecAttention.v.weight", kv[:, 1].reshape(heads * d, -1).contiguous()
                yield hf + "1.EncDecAttention.o.weight", read(ours + "cross_attention.linear_proj.weight")
            yield hf + f"{mlp}.layer_norm.weight", read(ours + "pre_mlp_norm.weight")
            fc1 = read(ours + "mlp.linear_fc1.weight")
            if shape.activation == "gated-gelu":
                yield hf + f"{mlp}.DenseReluDense.wi_0.weight", fc1[0].contiguous()
                yield hf + f"{mlp}.DenseReluDense.wi_1.weight", fc1[1].contiguous()
            else:
                yield hf + f"{mlp}.DenseReluDense.wi.weight", fc1
            yield hf + f"{mlp}.DenseReluDense.wo.weight", read(ours + "mlp.linear_fc2.weight")
        yield f"{stack}.final_layer_norm.weight", read(f"{stack}.final_norm.weight")
    if not shape.tie_embeddings:
        yield "lm_head.weight", read("output_layer.weight")


def t5_ignored(shape: T5Shape):
    """HF's copies of the shared table (each stack's embed_tokens; lm_head when tied)."""
    copies = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    if shape.tie_embeddings:
        copies.add("lm_head.weight")
    return copies.__contains__
