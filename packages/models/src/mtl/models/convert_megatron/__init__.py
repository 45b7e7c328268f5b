"""Megatron-Core ``torch_dist`` GPT checkpoint -> mtl ``gpt`` family.

``MegatronConverter().to_mtl(src_dir, *, vocab_size=None, **options) -> (model_section,
state)``: ``src_dir`` is one checkpoint (an ``iter_NNNNNNN`` folder of Megatron-LM, or any
``dist_checkpointing.save`` directory) saved at any TP/PP; ``state`` holds every parameter as
a full global fp32 tensor in ``mtl.models.param_layout``'s layout, the vocabulary cut to its
true ``vocab_size`` rows (Megatron pads it and does not record the true size). ``options``
are [model] keys that a checkpoint without Megatron-LM ``args`` cannot tell (see
``config.OPTIONS``). Optimizer state in the checkpoint is ignored. ``stream_to_mtl`` gives the
same tensors lazily (``metas`` first, then one stored tensor read at a time), for
``mtl convert``'s streaming writer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

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

    def stream_to_mtl(
        self, src_dir: str | Path, *, vocab_size: int | None = None, **options: Any
    ) -> tuple[dict[str, Any], "MegatronTensorStream"]:
        """(model section, the tensors as a stream: ``metas`` up front, then ``(name, tensor)``
        pairs read one stored tensor at a time), for writers that keep memory flat."""
        checkpoint = MegatronCheckpoint(src_dir)
        source = str(checkpoint.directory)
        layer_keys, top_keys = _classify(checkpoint, source)
        shapes = _stored_shapes(checkpoint, layer_keys, top_keys, source)
        section = model_section(checkpoint.common.get("args"), shapes, options, source)
        section["vocab_size"] = _true_vocab(vocab_size, shapes.vocab_rows, source)
        tensors = MegatronTensorStream(checkpoint, layer_keys, top_keys, shapes, section["vocab_size"])
        _check_complete(tensors.metas, section, source)
        return section, tensors

    def to_mtl(
        self, src_dir: str | Path, *, vocab_size: int | None = None, **options: Any
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        section, tensors = self.stream_to_mtl(src_dir, vocab_size=vocab_size, **options)
        return section, dict(tensors)

    def from_mtl(self, model_config, state: dict[str, torch.Tensor], dst_dir: str | Path, **options: Any) -> None:
        raise ConfigError(
            "export to Megatron is not supported yet: convert to Hugging Face (`mtl convert --to hf`) "
            "and import that with Megatron's Hugging Face tools"
        )


class MegatronTensorStream:
    """``metas`` (mtl name -> fp32 meta tensor of the global shape) and iteration yielding
    ``(name, tensor)``: each stored tensor is read once, a stacked one yielding its layers."""

    def __init__(self, checkpoint: MegatronCheckpoint, layer_keys, top_keys, shapes: StoredShapes, vocab_size: int):
        self.checkpoint, self.layer_keys, self.top_keys = checkpoint, layer_keys, top_keys
        self.shapes, self.vocab_size = shapes, vocab_size
        source = str(checkpoint.directory)
        self.metas: dict[str, torch.Tensor] = {}
        for key, stored in self._plan():
            for name, shape in stored:
                if name in self.metas:
                    raise CheckpointError(f"{source}: two stored tensors map to {name} (e.g. {key}); the checkpoint is ambiguous")
                self.metas[name] = torch.empty(shape, dtype=torch.float32, device="meta")

    def _plan(self):
        """Per stored key, its [(mtl name, global shape)] in the order iteration yields them."""
        for key in self.top_keys:
            shape = self.checkpoint.shape(key)
            if key in VOCAB_TABLES:
                shape = (self.vocab_size, *shape[1:])
            yield key, [(TOP_NAMES[key], shape)]
        for key, (layer, suffix) in self.layer_keys.items():
            shape = self.checkpoint.shape(key)
            layers = range(shape[0]) if layer is None else [layer]
            if layer is None:
                shape = shape[1:]
            if LAYER_NAMES[suffix].startswith("mlp.linear_fc1.") and self.shapes.gated:
                shape = (2, self.shapes.ffn_hidden_size, *shape[1:])
            yield key, [(f"layers.{i}.{LAYER_NAMES[suffix]}", shape) for i in layers]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key, stored in self._plan():
            tensor = self.checkpoint.read(key)
            if key in VOCAB_TABLES:
                tensor = tensor[: self.vocab_size]  # [padded_vocab, h] -> [vocab, h]
            if self.layer_keys.get(key, (0,))[0] is None:
                parts = list(tensor)  # stacked [layers, ...] -> [...] per layer
            else:
                parts = [tensor]
            del tensor
            for (name, shape), part in zip(stored, parts):
                # a copy, not a view: a view would keep (and torch.save would write) the whole stack
                yield name, part.reshape(shape).clone()

    def __len__(self) -> int:
        return len(self.metas)


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


__all__ = ["MegatronConverter", "MegatronTensorStream"]
