"""``ShardedTensor``: one rank's slice of a global tensor, and walking nested state dicts.

A state dict is a nested structure of dicts and lists whose leaves are either
``ShardedTensor``s (saved to zarr arrays, one per ``key``) or plain JSON-able values (the
"common" state, saved once by rank 0 in ``metadata.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mtl.core.errors import CheckpointError


@dataclass(eq=False)  # identity semantics: comparing tensors elementwise has no single truth value
class ShardedTensor:
    """This rank's slice ``data`` of the global tensor named ``key``.

    ``data`` occupies ``global_offset[d] : global_offset[d] + data.shape[d]`` in every
    dimension ``d`` of a tensor of ``global_shape``. ``replica_id != 0`` marks a copy of a
    slice that another rank (the one with ``replica_id == 0``) writes, e.g. a replicated
    layer norm on every TP rank, or the same shard on every DP rank.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple
    global_offset: tuple
    replica_id: int = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)
        self.global_offset = tuple(int(n) for n in self.global_offset)
        if not isinstance(self.key, str) or not self.key.strip(".") or "\\" in self.key:
            raise CheckpointError(
                f"ShardedTensor key {self.key!r} is not usable: give a non-empty name such as "
                "'decoder.layers.0.mlp.fc1.weight'"
            )
        if not isinstance(self.data, torch.Tensor):
            raise CheckpointError(f"ShardedTensor '{self.key}': data must be a torch.Tensor, got {type(self.data).__name__}")
        ndim = self.data.dim()
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise CheckpointError(
                f"ShardedTensor '{self.key}': local data has {ndim} dims {tuple(self.data.shape)} but "
                f"global_shape={self.global_shape} and global_offset={self.global_offset}; all three "
                "must have one entry per dimension"
            )
        for dim, (offset, size, total) in enumerate(zip(self.global_offset, self.data.shape, self.global_shape)):
            if offset < 0 or offset + size > total:
                raise CheckpointError(
                    f"ShardedTensor '{self.key}': dim {dim} slice [{offset}, {offset + size}) lies outside "
                    f"the global size {total}; fix global_offset or global_shape"
                )
        if self.replica_id < 0:
            raise CheckpointError(f"ShardedTensor '{self.key}': replica_id must be >= 0, got {self.replica_id}")

    @property
    def local_shape(self) -> tuple:
        return tuple(self.data.shape)

    @classmethod
    def from_split(
        cls, key: str, data: torch.Tensor, split_dim: int | None, rank: int, world: int, replica_id: int = 0
    ) -> "ShardedTensor":
        """The common case of a tensor split evenly along ``split_dim`` over ``world`` ranks
        (a TP weight split on its layout's ``tp_split_dim``), or replicated when ``split_dim`` is None."""
        global_shape = list(data.shape)
        global_offset = [0] * data.dim()
        if split_dim is not None:
            global_shape[split_dim] = data.shape[split_dim] * world
            global_offset[split_dim] = data.shape[split_dim] * rank
        elif rank != 0 and replica_id == 0:
            replica_id = rank  # a replicated tensor is written once, by rank 0
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id)


def _walk(state: Any, path: str, visit: Callable[[str, Any], Any]) -> Any:
    """Rebuild ``state`` with every leaf replaced by ``visit(path, leaf)``."""
    if isinstance(state, dict):
        return {k: _walk(v, f"{path}.{k}" if path else str(k), visit) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [_walk(v, f"{path}.{i}" if path else str(i), visit) for i, v in enumerate(state)]
        return items if isinstance(state, list) else tuple(items)
    return visit(path, state)


def flatten_state(state: Any) -> dict[str, ShardedTensor]:
    """Every ``ShardedTensor`` in a nested state, by its dotted path (``"model.layers.0"``).

    A rank may hold several boxes of one key (e.g. the pieces of a flat range, see
    ``flat_range``); two entries with the same key and offset would write one box twice:
    that is refused, naming both paths.
    """
    found: dict[str, ShardedTensor] = {}
    path_of_box: dict[tuple, str] = {}

    def visit(path: str, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            box = (leaf.key, leaf.global_offset)
            if box in path_of_box:
                raise CheckpointError(
                    f"ShardedTensor key '{leaf.key}' at offset {leaf.global_offset} appears twice in this "
                    f"rank's state (at '{path_of_box[box]}' and '{path}'); give each tensor a unique key"
                )
            path_of_box[box] = path
            found[path] = leaf
        return leaf

    _walk(state, "", visit)
    return found


SHARDED_PLACEHOLDER = "__mtl_sharded_tensor__"


def common_state(state: Any) -> Any:
    """The state with each ``ShardedTensor`` replaced by a small placeholder naming its key:
    what goes into ``metadata.json``. Non-JSON leaves are refused with their path."""

    def visit(path: str, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return {SHARDED_PLACEHOLDER: leaf.key}
        if isinstance(leaf, torch.Tensor):
            raise CheckpointError(
                f"state entry '{path}' is a plain torch.Tensor; wrap it in ShardedTensor (with "
                "replica_id != 0 on ranks that hold a copy) so it is stored as an array"
            )
        if leaf is None or isinstance(leaf, (bool, int, float, str)):
            return leaf
        raise CheckpointError(
            f"state entry '{path}' has type {type(leaf).__name__}, which JSON cannot hold; "
            "convert it to numbers/strings/lists/dicts or a ShardedTensor"
        )

    return _walk(state, "", visit)


def merge_common(template: Any, saved: Any, strict: bool, where: str = "") -> Any:
    """The template with its plain leaves replaced by the saved common values at the same
    path; ``ShardedTensor`` leaves are kept (load fills their data in place)."""
    if isinstance(template, ShardedTensor):
        return template
    if isinstance(template, dict):
        saved_dict = saved if isinstance(saved, dict) else {}
        merged = {}
        for k, v in template.items():
            path = f"{where}.{k}" if where else str(k)
            saved_key = k if k in saved_dict else str(k)  # JSON turned non-string keys into strings
            if saved_key not in saved_dict:
                if strict and not _holds_only_sharded(v):
                    raise CheckpointError(
                        f"common state entry '{path}' is not in the checkpoint (it has "
                        f"{sorted(map(str, saved_dict))[:8]}); load with strict=False to keep the template's value"
                    )
                merged[k] = v
            else:
                merged[k] = merge_common(v, saved_dict[saved_key], strict, path)
        return merged
    if isinstance(template, (list, tuple)):
        saved_list = saved if isinstance(saved, list) else []
        if strict and len(saved_list) < len(template) and not all(map(_holds_only_sharded, template[len(saved_list):])):
            raise CheckpointError(
                f"common state entry '{where}' has {len(saved_list)} items in the checkpoint but the template has "
                f"{len(template)}; load with strict=False to keep the template's extra items"
            )
        items = [
            merge_common(v, saved_list[i], strict, f"{where}.{i}") if i < len(saved_list) else v
            for i, v in enumerate(template)
        ]
        return items if isinstance(template, list) else tuple(items)
    return saved


def _holds_only_sharded(state: Any) -> bool:
    """True when every leaf below ``state`` is a ShardedTensor (their keys are checked separately)."""
    leaves: list[Any] = []
    _walk(state, "", lambda _p, leaf: leaves.append(leaf))
    return all(isinstance(leaf, ShardedTensor) for leaf in leaves)
