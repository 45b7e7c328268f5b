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
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), tie_embeddings=hf.get("tie_word_embeddings", True),
        scale_decoder_output=_scaled(hf),
    )


def _scaled(hf: dict[str, Any]) -> bool:
    """T5 1.0 rescales the decoder output, 1.1 and Flan-T5 do not. Their config.json files said
    so with ``tie_word_embeddings`` (1.1's head is its own table: ``lm_head.weight`` is stored);
    transformers 5 writes ``scale_decoder_outputs`` and always ``tie_word_embeddings = true``,
    storing no ``lm_head.weight`` (its head reads the embedding)."""
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


# -- the ``hf`` converter record of the t5 family (``mtl convert``) ---------------------------

def t5_model_section(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Our ``[model]`` keys for a T5 config.json."""
    shape = t5_shape(hf, source)
    return {
        "family": "t5", "num_layers": shape.num_layers, "num_decoder_layers": shape.num_decoder_layers,
        "hidden_size": shape.hidden_size, "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_attention_heads, "head_dim": shape.head_dim,
        "ffn_hidden_size": shape.ffn_hidden_size, "vocab_size": shape.vocab_size, "activation": shape.activation,
        "relative_attention_num_buckets": shape.relative_attention_num_buckets,
        "relative_attention_max_distance": shape.relative_attention_max_distance, "normalization": "rmsnorm",
        "norm_eps": shape.norm_eps, "bias": False, "tie_embeddings": shape.tie_embeddings,
        "scale_decoder_output": shape.scale_decoder_output,
    }


def _shape_of(section) -> T5Shape:
    """A T5Shape from a [model] section dict or a resolved ModelConfig (vocabulary rows as stored)."""
    get = section.get if isinstance(section, dict) else lambda key, default=None: getattr(section, key, default)
    return T5Shape(
        vocab_size=get("vocab_size"), padded_vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        num_layers=get("num_layers"), num_decoder_layers=get("num_decoder_layers") or get("num_layers"),
        num_attention_heads=get("num_attention_heads"), head_dim=get("head_dim"),
        ffn_hidden_size=get("ffn_hidden_size"), activation=get("activation"),
        relative_attention_num_buckets=get("relative_attention_num_buckets"),
        relative_attention_max_distance=get("relative_attention_max_distance"), tie_embeddings=get("tie_embeddings"),
        scale_decoder_output=get("scale_decoder_output"),
    )


def check_t5_exportable(m) -> None:
    if m.family != "t5":
        raise ConfigError(f"T5 export needs model.family = 't5' (have {m.family!r})")


def t5_config(m, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": m.vocab_size,
        "d_model": m.hidden_size, "d_kv": m.head_dim, "d_ff": m.ffn_hidden_size, "num_layers": m.num_layers,
        "num_decoder_layers": m.num_decoder_layers, "num_heads": m.num_attention_heads,
        "relative_attention_num_buckets": m.relative_attention_num_buckets,
        "relative_attention_max_distance": m.relative_attention_max_distance, "layer_norm_epsilon": m.norm_eps,
        "feed_forward_proj": m.activation, "tie_word_embeddings": m.tie_embeddings,
        "scale_decoder_outputs": m.scale_decoder_output, "dropout_rate": m.hidden_dropout, "is_encoder_decoder": True,
        "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, "dtype": str(dtype).removeprefix("torch."),
    }


def t5_converter():
    """The ``hf`` converter of the ``t5`` family."""
    from mtl.models.convert_hf import HFArchitecture, HFConverter

    arch = HFArchitecture("t5", t5_model_section, lambda section, read: t5_to_mtl(_shape_of(section), read),
                          lambda section: t5_ignored(_shape_of(section)), check_t5_exportable,
                          lambda m, read: t5_from_mtl(_shape_of(m), read), t5_config)
    return HFConverter({"t5": arch}, moe_types=(), default=lambda m: "t5")
