"""Which stored tensors make each mtl tensor of a Megatron-Core GPT checkpoint, and reading
them one mtl tensor at a time.

An mtl tensor is assembled from ``Piece``s: a slice of one stored tensor (a layer of a
stacked key), per expert when the experts were saved one by one, per half when a gated fc1
was saved as ``_w``/``_v``. A stored tensor is read once and kept only while mtl tensors
still to come use it, so memory stays about one stored tensor (a stacked one holds every
layer: Megatron's layout, not ours).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from mtl.core.errors import CheckpointError, ConfigError
from mtl.models.convert_megatron.dcp_reader import MegatronCheckpoint
from mtl.models.convert_megatron.names import (
    FC1_NAMES,
    LAYER_NAMES,
    TOP_NAMES,
    VOCAB_TABLES,
    StoredKey,
    is_model_key,
    parse_layer_key,
    unsupported_feature,
)

EXPERT_NAMES = ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")


@dataclass(frozen=True)
class Piece:
    key: str
    index: tuple[int, ...]  # into the stored tensor (the layer of a stacked key)
    shape: tuple[int, ...]  # of the slice
    expert: int | None  # None: every expert (or not an expert tensor)
    half: int | None


class TensorPlan:
    """mtl name -> its pieces, and the raw (pre-reshape) shape each assembles to."""

    def __init__(self, checkpoint: MegatronCheckpoint):
        self.checkpoint, self.source = checkpoint, str(checkpoint.directory)
        self.pieces: dict[str, list[Piece]] = {}
        unknown: list[str] = []
        for key in checkpoint.tensors:
            if not is_model_key(key):
                continue
            feature = unsupported_feature(key)
            if feature:
                raise ConfigError(f"{self.source}: tensor {key} belongs to {feature}, which mtl's GPT does not support")
            stored = parse_layer_key(key)
            if key in TOP_NAMES:
                self._add(TOP_NAMES[key], Piece(key, (), checkpoint.shape(key), None, None))
            elif stored is not None and stored.suffix in LAYER_NAMES:
                self._add_layer_key(stored)
            else:
                unknown.append(key)
        if unknown:
            raise CheckpointError(
                f"{self.source}: {len(unknown)} stored tensors have no place in mtl's GPT, e.g. {sorted(unknown)[:4]}; "
                "the checkpoint uses a feature this converter does not support"
            )
        if "embedding.word_embeddings.weight" not in self.pieces:
            raise CheckpointError(
                f"{self.source}: no embedding.word_embeddings.weight; is this a Megatron-Core GPT checkpoint "
                f"(stored keys e.g. {sorted(checkpoint.tensors)[:4]})?"
            )
        self.raw_shapes = {name: self._raw_shape(name, pieces) for name, pieces in self.pieces.items()}

    def _add(self, name: str, piece: Piece) -> None:
        self.pieces.setdefault(name, []).append(piece)

    def _add_layer_key(self, stored: StoredKey) -> None:
        shape = self.checkpoint.shape(stored.key)
        layers = [(stored.layer, ())] if stored.layer is not None else [(i, (i,)) for i in range(shape[0])]
        if stored.layer is None:
            shape = shape[1:]
        for layer, index in layers:
            piece = Piece(stored.key, index, shape, stored.expert, stored.half)
            self._add(f"layers.{layer}.{LAYER_NAMES[stored.suffix]}", piece)

    def _raw_shape(self, name: str, pieces: list[Piece]) -> tuple[int, ...]:
        """Experts stacked first (where saved one by one), halves concatenated along the rows."""
        per_expert = [p for p in pieces if p.expert is not None]
        if per_expert and len(per_expert) != len(pieces):
            raise CheckpointError(f"{self.source}: {name} is stored both per expert and grouped")
        experts = sorted({p.expert for p in per_expert})
        if experts and experts != list(range(len(experts))):
            raise CheckpointError(f"{self.source}: {name} stores experts {experts}, not 0..E-1 (a partial checkpoint?)")
        groups = [[p for p in pieces if p.expert == e] for e in experts] or [pieces]
        shapes = []
        for group in groups:
            halves = sorted(p.half for p in group if p.half is not None)
            if (halves and halves != [0, 1]) or (not halves and len(group) != 1):
                raise CheckpointError(f"{self.source}: {name} has stored pieces {[p.key for p in group]} that do not "
                                      "make one tensor (a gated fc1 needs both _w and _v)")
            rows_dim = 0 if experts or name.split(".", 2)[-1] not in EXPERT_NAMES else 1
            shape = list(group[0].shape)
            shape[rows_dim] = sum(p.shape[rows_dim] for p in group)
            shapes.append(tuple(shape))
        if any(s != shapes[0] for s in shapes):
            raise CheckpointError(f"{self.source}: the experts of {name} differ in shape: {sorted(set(shapes))}")
        return (len(experts), *shapes[0]) if experts else shapes[0]

    def gated(self) -> bool:
        """Whether the MLPs are gated (fc1 holds 2 * ffn rows for fc2's ffn columns); every
        kind of MLP in the checkpoint (dense, experts, shared expert) must agree."""
        answers = {}
        for name, shape in self.raw_shapes.items():
            for fc1 in FC1_NAMES:
                if name.endswith("." + fc1):
                    fc2 = self.raw_shapes.get(name.replace("linear_fc1", "linear_fc2"))
                    if fc2 is None:
                        raise CheckpointError(f"{self.source}: {name} is stored but not its linear_fc2")
                    rows, ffn = shape[-2], fc2[-1]
                    if rows not in (ffn, 2 * ffn):
                        raise CheckpointError(f"{self.source}: {name} has {rows} rows; expected {ffn} or {2 * ffn} "
                                              f"(its fc2 is [h, {ffn}])")
                    answers[fc1] = rows == 2 * ffn
        if len(set(answers.values())) > 1:
            raise ConfigError(f"{self.source}: gated and plain MLPs mixed ({answers}); mtl's GPT has one activation")
        if not answers:
            raise CheckpointError(f"{self.source}: no decoder.layers.mlp.linear_fc1 of any kind; not a GPT checkpoint?")
        return next(iter(answers.values()))

    def final_shape(self, name: str, gated: bool, vocab_size: int) -> tuple[int, ...]:
        shape = self.raw_shapes[name]
        if name in VOCAB_TABLES:
            return (vocab_size, *shape[1:])
        suffix = name.split(".", 2)[-1]
        if gated and suffix in FC1_NAMES:
            return (*shape[:-2], 2, shape[-2] // 2, shape[-1])
        if gated and suffix == "mlp.linear_fc1.bias":  # [2 * ffn] -> our [2, ffn]
            return (2, shape[0] // 2)
        return shape


class MegatronTensorStream:
    """``metas`` (mtl name -> fp32 meta tensor of the global shape) and iteration yielding
    ``(name, tensor)``, reading each stored tensor once."""

    def __init__(self, plan: TensorPlan, gated: bool, vocab_size: int):
        self.plan, self.vocab_size = plan, vocab_size
        order = {key: i for i, key in enumerate(plan.checkpoint.tensors)}
        # names sharing a stacked stored tensor come one after another, so it is read once
        self.order = sorted(plan.pieces, key=lambda n: min(order[p.key] for p in plan.pieces[n]))
        self.metas = {name: torch.empty(plan.final_shape(name, gated, vocab_size), dtype=torch.float32, device="meta")
                      for name in self.order}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        uses: dict[str, int] = {}
        for pieces in self.plan.pieces.values():
            for p in pieces:
                uses[p.key] = uses.get(p.key, 0) + 1
        cache: dict[str, torch.Tensor] = {}

        def take(piece: Piece) -> torch.Tensor:
            if piece.key not in cache:
                cache[piece.key] = self.plan.checkpoint.read(piece.key)
            part = cache[piece.key][piece.index]
            uses[piece.key] -= 1
            if not uses[piece.key]:
                del cache[piece.key]
            return part

        for name in self.order:
            tensor = self._assemble(name, take)
            if name in VOCAB_TABLES:
                tensor = tensor[: self.vocab_size]  # [padded_vocab, h] -> [vocab, h]
            # a copy, not a view: a view would keep (and torch.save would write) the whole stack
            yield name, tensor.reshape(self.metas[name].shape).clone()
            del tensor

    def _assemble(self, name: str, take) -> torch.Tensor:
        pieces = sorted(self.plan.pieces[name], key=lambda p: (p.expert or 0, p.half or 0))
        if pieces[0].expert is not None:
            experts: dict[int, list[torch.Tensor]] = {}
            for p in pieces:
                experts.setdefault(p.expert, []).append(take(p))
            return torch.stack([torch.cat(parts) for _, parts in sorted(experts.items())])
        rows_dim = 1 if name.split(".", 2)[-1] in EXPERT_NAMES else 0
        return torch.cat([take(p) for p in pieces], dim=rows_dim)

    def __len__(self) -> int:
        return len(self.metas)
