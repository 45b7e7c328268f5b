"""Megatron-Core ``torch_dist`` GPT checkpoints <-> the mtl ``gpt`` family.

Import: ``MegatronConverter().to_mtl(src, *, vocab_size=None, iteration=None, **options) ->
(model_section, state)``. ``src`` is Megatron-LM's save directory (the newest iteration its
``latest_checkpointed_iteration.txt`` names, or ``iteration``) or one checkpoint folder (any
``dist_checkpointing.save`` directory), saved at any TP/PP/EP, dense or MoE; ``state`` holds
every parameter as a full global fp32 tensor in ``mtl.models.param_layout``'s layout, the
vocabulary cut to its true size: ``vocab_size`` if given, else Megatron-LM's
``args.vocab_size``, else ``tokenizer_vocab_size`` (the caller's tokenizer), else every stored
(padded) row with a warning. ``options`` are [model] keys that a checkpoint without
Megatron-LM ``args`` cannot tell (``config.OPTIONS``). Optimizer state is ignored.
``stream_to_mtl`` gives the same tensors lazily, for ``mtl convert``'s streaming writer.

Export: ``from_mtl(model_config, source, dst, tp=1, pp=1, spec="local", iteration=0)`` writes
a save directory Megatron-Core loads (``export.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_megatron.config import StoredShapes, model_section
from mtl.models.convert_megatron.dcp_reader import MegatronCheckpoint
from mtl.models.convert_megatron.directory import checkpoint_dir
from mtl.models.convert_megatron.export import export_checkpoint
from mtl.models.convert_megatron.importer import EXPERT_NAMES, MegatronTensorStream, TensorPlan

log = logging.getLogger(__name__)


class MegatronConverter:
    """The ``megatron`` converter of the ``gpt`` model family."""

    def stream_to_mtl(
        self, src: str | Path, *, vocab_size: int | None = None, iteration: int | None = None,
        tokenizer_vocab_size: int | None = None, **options: Any,
    ) -> tuple[dict[str, Any], MegatronTensorStream]:
        """(model section, the tensors as a stream: ``metas`` up front, then ``(name, tensor)``
        pairs, each stored tensor read once), for writers that keep memory flat."""
        checkpoint = MegatronCheckpoint(checkpoint_dir(src, iteration))
        plan = TensorPlan(checkpoint)
        shapes = _stored_shapes(plan)
        args = checkpoint.common.get("args")
        section = model_section(args, shapes, options, plan.source)
        saved = getattr(args, "vocab_size", None) if args is not None else None
        section["vocab_size"] = _true_vocab(vocab_size, saved, tokenizer_vocab_size, shapes.vocab_rows, plan.source)
        return section, MegatronTensorStream(plan, shapes.gated, section["vocab_size"])

    def to_mtl(self, src: str | Path, **options: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        section, tensors = self.stream_to_mtl(src, **options)
        return section, dict(tensors)

    def from_mtl(self, model_config, state, dst_dir: str | Path, **options: Any) -> list[str]:
        """Write a Megatron-LM save directory at ``dst_dir``; returns the files written."""
        return export_checkpoint(model_config, state, dst_dir, **options)


def _stored_shapes(plan: TensorPlan) -> StoredShapes:
    shapes, source = plan.raw_shapes, plan.source
    layer_ids = sorted({int(name.split(".")[1]) for name in shapes if name.startswith("layers.")})
    if layer_ids != list(range(len(layer_ids))) or not layer_ids:
        raise CheckpointError(f"{source}: the stored layers {layer_ids} are not 0..N-1 (a partial checkpoint?)")

    def first(suffix: str) -> tuple[int, ...] | None:
        return next((shapes[f"layers.{i}.{suffix}"] for i in layer_ids if f"layers.{i}.{suffix}" in shapes), None)

    moe_layers = [i for i in layer_ids if f"layers.{i}.mlp.router.weight" in shapes]
    for i in layer_ids:
        needed = ["mlp.router.weight", *EXPERT_NAMES] if i in moe_layers else ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        missing = [n for n in needed if f"layers.{i}.{n}" not in shapes]
        if missing:
            raise CheckpointError(f"{source}: layer {i} lacks {missing} (stored under decoder.layers.)")
    vocab_rows, hidden = shapes["embedding.word_embeddings.weight"]
    positions = shapes.get("embedding.position_embeddings.weight")
    dense, experts, shared = first("mlp.linear_fc2.weight"), first("mlp.experts.linear_fc2.weight"), first(
        "mlp.shared_experts.linear_fc2.weight")
    qkv = first("self_attention.linear_qkv.weight")
    if qkv is None:
        raise CheckpointError(f"{source}: decoder.layers.self_attention.linear_qkv.weight is not stored")
    return StoredShapes(
        num_layers=len(layer_ids),
        hidden_size=hidden,
        vocab_rows=vocab_rows,
        qkv_rows=qkv[0],
        ffn_hidden_size=dense[-1] if dense else None,
        gated=plan.gated(),
        learned_positions=positions[0] if positions else None,
        bias=first("self_attention.linear_proj.bias") is not None,
        qkv_bias=first("self_attention.linear_qkv.bias") is not None,
        qk_norm=first("self_attention.q_norm.weight") is not None,
        tied="output_layer.weight" not in shapes,
        moe_layers=moe_layers,
        num_experts=first("mlp.router.weight")[0] if moe_layers else 0,
        moe_ffn_hidden_size=experts[-1] if experts else None,
        shared_ffn_hidden_size=shared[-1] if shared else 0,
        shared_gate=first("mlp.shared_experts_gate.weight") is not None,
    )


def _true_vocab(explicit: int | None, saved: int | None, tokenizer: int | None, rows: int, source: str) -> int:
    """The true vocabulary: given > Megatron-LM's args.vocab_size > the tokenizer's > every row."""
    for value, origin in ((explicit, "vocab_size"), (saved, "args.vocab_size"), (tokenizer, "the tokenizer's vocabulary")):
        if value is None:
            continue
        if not 0 < value <= rows:
            raise ConfigError(f"{origin} = {value}, but {source} stores {rows} vocabulary rows")
        return value
    log.warning(
        "%s: the true vocabulary size is unknown (no args.vocab_size, no tokenizer); using all %d stored (padded) "
        "rows. Pass --vocab-size (your tokenizer's vocabulary) or --tokenizer DIR to drop the padding",
        source,
        rows,
    )
    return rows


__all__ = ["MegatronConverter", "MegatronTensorStream"]
