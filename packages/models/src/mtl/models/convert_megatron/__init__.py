"""Megatron-Core ``torch_dist`` GPT checkpoint -> mtl ``gpt`` family.

``MegatronConverter().to_mtl(src_dir, *, vocab_size=None, **options) -> (model_section,
state)``: ``src_dir`` is one checkpoint (an ``iter_NNNNNNN`` folder of Megatron-LM, or any
``dist_checkpointing.save`` directory) saved at any TP/PP; ``state`` holds every parameter as
a full global fp32 tensor in ``mtl.models.param_layout``'s layout, the vocabulary cut to its
true ``vocab_size`` rows (Megatron pads it and does not record the true size). ``options``
are [model] keys that a checkpoint without Megatron-LM ``args`` cannot tell (see
``config.OPTIONS``). Optimizer state in the checkpoint is ignored.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_megatron.config import StoredShapes, model_section
from mtl.models.convert_megatron.dcp_reader import MegatronCheckpoint
from mtl.models.convert_megatron.names import (
    LAYER_NAMES,
    TOP_NAMES,
    VOCAB_TABLES,
    is_model_key,
    split_layer_key,
    unsupported_feature,
)

log = logging.getLogger(__name__)


class MegatronConverter:
    """The ``megatron`` converter of the ``gpt`` model family (import only)."""

    def to_mtl(
        self, src_dir: str | Path, *, vocab_size: int | None = None, **options: Any
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        checkpoint = MegatronCheckpoint(src_dir)
        source = str(checkpoint.directory)
        layer_keys, top_keys = _classify(checkpoint, source)
        shapes = _stored_shapes(checkpoint, layer_keys, top_keys, source)
        section = model_section(checkpoint.common.get("args"), shapes, options, source)
        section["vocab_size"] = _true_vocab(vocab_size, shapes.vocab_rows, source)

        state: dict[str, torch.Tensor] = {}
        for key in top_keys:
            tensor = checkpoint.read(key)
            if key in VOCAB_TABLES:
                tensor = tensor[: section["vocab_size"]]  # [padded_vocab, h] -> [vocab, h]
            state[TOP_NAMES[key]] = tensor
        for key, (layer, suffix) in layer_keys.items():
            ours = LAYER_NAMES[suffix]
            tensor = checkpoint.read(key)
            if layer is None:
                if tensor.shape[0] != shapes.num_layers:
                    raise CheckpointError(
                        f"{source}: {key} stacks {tensor.shape[0]} layers, other tensors {shapes.num_layers}"
                    )
                per_layer = dict(enumerate(tensor))  # [layers, ...] -> views [...]
            else:
                per_layer = {layer: tensor}
            for i, t in per_layer.items():
                if ours.startswith("mlp.linear_fc1.") and shapes.gated:
                    t = t.view(2, shapes.ffn_hidden_size, *t.shape[1:])  # [2 * ffn, ...] -> [2, ffn, ...]
                name = f"layers.{i}.{ours}"
                if name in state:
                    raise CheckpointError(f"{source}: two stored tensors map to {name} (e.g. {key}); the checkpoint is ambiguous")
                state[name] = t
        _check_complete(state, section, source)
        return section, state

    def from_mtl(self, model_config, state: dict[str, torch.Tensor], dst_dir: str | Path) -> None:
        raise ConfigError(
            "export to Megatron is not supported yet: convert to Hugging Face (`mtl convert --to hf`) "
            "and use Megatron-Bridge/Megatron-LM's HF importer"
        )


def _classify(checkpoint: MegatronCheckpoint, source: str):
    """The model tensors: ({key: (layer or None, suffix)} of the transformer layers, [top-level
    keys]); anything else of the model is refused by name."""
    layer_keys: dict[str, tuple[int | None, str]] = {}
    top_keys: list[str] = []
    unknown: list[str] = []
    for key in checkpoint.tensors:
        if not is_model_key(key):
            continue
        feature = unsupported_feature(key)
        if feature:
            raise ConfigError(f"{source}: tensor {key} belongs to {feature}, which mtl's GPT does not support")
        split = split_layer_key(key)
        if split is not None and split[1] in LAYER_NAMES:
            layer_keys[key] = split
        elif key in TOP_NAMES:
            top_keys.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(
            f"{source}: {len(unknown)} stored tensors have no place in mtl's GPT, e.g. {sorted(unknown)[:4]}; "
            "the checkpoint uses a feature this converter does not support"
        )
    if "embedding.word_embeddings.weight" not in top_keys:
        raise CheckpointError(
            f"{source}: no embedding.word_embeddings.weight; is this a Megatron-Core GPT checkpoint "
            f"(stored keys e.g. {sorted(checkpoint.tensors)[:4]})?"
        )
    return layer_keys, top_keys


def _stored_shapes(checkpoint: MegatronCheckpoint, layer_keys, top_keys, source: str) -> StoredShapes:
    by_suffix: dict[str, list[tuple[int, ...]]] = {}
    layer_ids: set[int] = set()
    for key, (layer, suffix) in layer_keys.items():
        shape = checkpoint.shape(key)
        if layer is None:
            layer_ids.update(range(shape[0]))
            shape = shape[1:]
        else:
            layer_ids.add(layer)
        by_suffix.setdefault(suffix, []).append(shape)

    def layer_shape(suffix: str) -> tuple[int, ...]:
        if suffix not in by_suffix:
            raise CheckpointError(f"{source}: decoder.layers.{suffix} is not stored; not a GPT decoder checkpoint?")
        return by_suffix[suffix][0]

    if layer_ids != set(range(len(layer_ids))):
        raise CheckpointError(f"{source}: the stored layers {sorted(layer_ids)} are not 0..N-1 (a partial checkpoint?)")
    vocab_rows, hidden = checkpoint.shape("embedding.word_embeddings.weight")
    ffn = layer_shape("mlp.linear_fc2.weight")[-1]
    fc1_rows = layer_shape("mlp.linear_fc1.weight")[0]
    if fc1_rows not in (ffn, 2 * ffn):
        raise CheckpointError(f"{source}: mlp.linear_fc1 has {fc1_rows} rows; expected {ffn} or {2 * ffn} (fc2 is [h, {ffn}])")
    positions = "embedding.position_embeddings.weight"
    return StoredShapes(
        num_layers=len(layer_ids),
        hidden_size=hidden,
        vocab_rows=vocab_rows,
        qkv_rows=layer_shape("self_attention.linear_qkv.weight")[0],
        ffn_hidden_size=ffn,
        gated=fc1_rows == 2 * ffn,
        learned_positions=checkpoint.shape(positions)[0] if positions in top_keys else None,
        bias="self_attention.linear_proj.bias" in by_suffix,
        qkv_bias="self_attention.linear_qkv.bias" in by_suffix,
        qk_norm="self_attention.q_layernorm.weight" in by_suffix,
        tied="output_layer.weight" not in top_keys,
    )


def _true_vocab(vocab_size: int | None, vocab_rows: int, source: str) -> int:
    if vocab_size is None:
        log.warning(
            "%s: Megatron does not record the true vocabulary size; using all %d stored (padded) rows. "
            "Pass vocab_size (mtl convert --vocab-size) = your tokenizer's vocabulary to drop the padding",
            source,
            vocab_rows,
        )
        return vocab_rows
    if not 0 < vocab_size <= vocab_rows:
        raise ConfigError(f"vocab_size = {vocab_size}, but {source} stores {vocab_rows} vocabulary rows")
    return vocab_size


def _check_complete(state: dict[str, torch.Tensor], section: dict[str, Any], source: str) -> None:
    """Every tensor the mtl model will ask for is present (one missing norm would otherwise
    surface later as a layout error without the checkpoint's name)."""
    per_layer = ["input_norm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_norm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    needed = ["embedding.word_embeddings.weight", "final_norm.weight"]
    if not section["tie_embeddings"]:
        needed.append("output_layer.weight")
    needed += [f"layers.{i}.{n}" for i in range(section["num_layers"]) for n in per_layer]
    missing = [n for n in needed if n not in state]
    if missing:
        raise CheckpointError(f"{source}: the checkpoint lacks tensors for {missing[:4]} ({len(missing)} in all)")


__all__ = ["MegatronConverter"]
