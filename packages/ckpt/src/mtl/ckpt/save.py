"""``save``: every rank writes its own shards of one checkpoint, in parallel, then rank 0 commits.

The save runs in three phases so that ``AsyncSaver`` can move the middle one to a thread:

1. ``prepare_save`` (collective): gather every rank's shard descriptions, check that they
   tile each tensor, and let rank 0 create ``iter_N.partial/`` with one empty array per key.
2. ``write_shards`` (local file I/O only, no collectives): write this rank's ``replica_id
   == 0`` shards, read them back and checksum them.
3. ``finalize_save`` (collective): gather the checksums; rank 0 writes ``metadata.json``,
   checks that every shard was written, renames to ``iter_N`` and replaces ``latest``.

Any failure on any rank is gathered and raised on all ranks, so none waits forever and no
incomplete checkpoint is ever committed.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from mtl.ckpt import __version__, directory, storage
from mtl.ckpt.collectives import SaveGroup
from mtl.ckpt.layout import ShardRecord, TensorLayout, plan_layout
from mtl.ckpt.retention import discard_iteration
from mtl.ckpt.sharded import ShardedTensor, common_state, flatten_state
from mtl.core.errors import CheckpointError

__all__ = ["save", "prepare_save", "write_shards", "finalize_save", "SavePlan"]


@dataclass
class SavePlan:
    """Everything phases 2 and 3 need, fixed by phase 1."""

    ckpt_dir: str
    iteration: int
    group: SaveGroup
    layouts: dict[str, TensorLayout]
    own_shards: list[tuple[ShardRecord, ShardedTensor]]  # shards this rank writes
    common: Any
    metadata: dict[str, Any]
    host_arrays: list[np.ndarray] = field(default_factory=list)  # filled by snapshot()

    @property
    def partial_dir(self) -> str:
        return directory.partial_dir(self.ckpt_dir, self.iteration)

    def array_relpath(self, key: str) -> str:
        return os.path.join(directory.ARRAYS_DIR, storage.array_dirname(key))

    def snapshot(self, copy: bool) -> None:
        """Device -> host copy of this rank's shards, as the numpy arrays that go to disk.

        ``copy=True`` (async save) clones CPU tensors too, so training may update the
        parameters in place while the writer thread still reads the snapshot."""
        self.host_arrays = []
        for _, shard in self.own_shards:
            host = shard.data.detach().to("cpu", copy=copy)
            self.host_arrays.append(storage.to_storage_array(host))


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run a local step; return its result or its error message (to be shared with all ranks)."""
    try:
        return fn(), None
    except CheckpointError as exc:
        return None, str(exc)
    except Exception as exc:  # an OS or tensorstore error: keep its type for the report
        return None, f"{type(exc).__name__}: {exc}"


def _check_json(name: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {name} is not JSON-able ({exc}); store numbers, strings, lists and dicts") from exc


def _describe_local(state: Any, metadata: dict, rank: int) -> tuple[list[ShardRecord], dict[tuple, ShardedTensor], Any]:
    if not isinstance(metadata, dict):
        raise CheckpointError(f"save(metadata=...) must be a dict, got {type(metadata).__name__}")
    # An empty box of a non-empty tensor (e.g. a TP rank holding only vocabulary padding) has
    # nothing to write; an empty tensor is still described, so its array exists.
    flat = {path: shard for path, shard in flatten_state(state).items()
            if shard.data.numel() > 0 or math.prod(shard.global_shape) == 0}
    by_box = {(shard.key, shard.global_offset): shard for shard in flat.values()}
    records = [
        ShardRecord(
            key=shard.key,
            dtype=storage.dtype_name(shard.data.dtype),
            global_shape=shard.global_shape,
            offset=shard.global_offset,
            shape=shard.local_shape,
            replica_id=shard.replica_id,
            rank=rank,
        )
        for shard in flat.values()
    ]
    common = common_state(state)
    if rank == 0:
        _check_json("metadata", metadata)
        _check_json("common state", common)
    return records, by_box, common


def _check_same_target(per_rank: list) -> None:
    """Every rank of the group must save the same iteration into the same directory."""
    first = per_rank[0][0]
    for rank, (target, _) in enumerate(per_rank):
        if target != first:
            raise CheckpointError(
                f"rank 0 saves iteration {first[1]} to {first[0]} but rank {rank} saves iteration {target[1]} "
                f"to {target[0]}; call save with the same ckpt_dir and iteration on every rank"
            )


def _interrupted_commit(ckpt_dir: str, iteration: int) -> bool:
    """True when ``iter_N`` exists but ``latest`` names an older iteration or nothing."""
    try:
        return directory.latest_iteration(ckpt_dir) < iteration
    except CheckpointError:  # no (readable) `latest`: nothing was ever fully committed
        return True


def _create_partial(plan: SavePlan) -> None:
    """Rank 0: a fresh ``iter_N.partial`` holding an empty zarr group and one array per key."""
    final = directory.iteration_dir(plan.ckpt_dir, plan.iteration)
    if os.path.exists(final) and _interrupted_commit(plan.ckpt_dir, plan.iteration):
        # Renamed, but `latest` was never moved to it (a crash between the two): no run
        # resumed from it, and the run saving now replaces it.
        discard_iteration(plan.ckpt_dir, plan.iteration)
    if os.path.exists(final):
        raise CheckpointError(
            f"iteration {plan.iteration} is already committed at {final}; save under a new iteration or "
            "delete that directory first"
        )
    os.makedirs(plan.ckpt_dir, exist_ok=True)
    directory.create_partial(plan.partial_dir)
    for key, layout in plan.layouts.items():
        path = os.path.join(plan.partial_dir, plan.array_relpath(key))
        storage.create_array(path, layout.global_shape, layout.chunk_shape, layout.dtype)


def prepare_save(
    state: Any, ckpt_dir: str, iteration: int, metadata: dict[str, Any], process_group: Any = None
) -> SavePlan:
    """Phase 1 (collective): validate the global layout and create the empty arrays."""
    if not isinstance(iteration, int) or iteration < 0:
        raise CheckpointError(f"save(iteration={iteration!r}): the iteration must be an int >= 0")
    group = SaveGroup.resolve(process_group)
    described, error = _attempt(lambda: _describe_local(state, metadata, group.rank))
    group.agree_on_failures(error, "describing the state")
    records, by_box, common = described

    target = (os.path.abspath(ckpt_dir), iteration)
    per_rank = group.all_gather_object((target, records))
    gathered = [rec for _, rank_records in per_rank for rec in rank_records]
    layouts, error = _attempt(lambda: _check_same_target(per_rank) or plan_layout(gathered))
    group.agree_on_failures(error, "checking the shard layout")

    own = [(rec, by_box[(rec.key, rec.offset)]) for layout in layouts.values() for rec in layout.written_by(group.rank)]
    plan = SavePlan(target[0], iteration, group, layouts, own, common, metadata)
    error = None
    if group.is_coordinator:
        _, error = _attempt(lambda: _create_partial(plan))
    group.agree_on_failures(error, f"creating {plan.partial_dir}")
    return plan


def write_shards(plan: SavePlan) -> list[dict[str, Any]]:
    """Phase 2 (this rank only): write each owned shard and checksum it.

    Returns one record per shard: ``{"key", "offset", "shape", "sha256"}``. The chunk grid
    follows shard boundaries, so no other rank touches the chunks written here. Every write
    is started at once (tensorstore's I/O threads run them, reading the host arrays in place)
    and this thread hashes the same arrays meanwhile; the phase ends when all are on disk.
    The sha256 is of the data handed to the writer, and ``load`` verifies it on every read."""
    written = []
    opened: dict[str, Any] = {}
    pending = []
    for (rec, _), data in zip(plan.own_shards, plan.host_arrays):
        if rec.key not in opened:
            opened[rec.key] = storage.open_array(os.path.join(plan.partial_dir, plan.array_relpath(rec.key)), rec.key)
        pending.append(storage.start_write(opened[rec.key], rec.offset, data))
        written.append({"key": rec.key, "offset": list(rec.offset), "shape": list(rec.shape), "sha256": storage.checksum(data)})
    for future in pending:
        storage.finish_write(future)
    return written


def _manifest(plan: SavePlan, written: list[dict[str, Any]]) -> dict[str, Any]:
    shards_by_key: dict[str, list[dict[str, Any]]] = {key: [] for key in plan.layouts}
    for entry in written:
        shards_by_key[entry["key"]].append({k: entry[k] for k in ("offset", "shape", "sha256")})
    tensors = {}
    for key, layout in plan.layouts.items():
        expected = len(layout.writers)
        if len(shards_by_key[key]) != expected:  # the verification before commit
            raise CheckpointError(
                f"tensor '{key}': {len(shards_by_key[key])} of {expected} shards were written; not committing"
            )
        tensors[key] = {
            "path": plan.array_relpath(key),
            "global_shape": list(layout.global_shape),
            "dtype": layout.dtype,
            "storage_dtype": storage.storage_dtype(layout.dtype),
            "chunk_shape": list(layout.chunk_shape),
            "shards": sorted(shards_by_key[key], key=lambda s: s["offset"]),
        }
        if not storage.is_array(os.path.join(plan.partial_dir, tensors[key]["path"])):
            raise CheckpointError(f"tensor '{key}': its array metadata vanished from {plan.partial_dir}; not committing")
    return {
        "format": directory.FORMAT_NAME,
        "format_version": directory.FORMAT_VERSION,
        "iteration": plan.iteration,
        "world_size": plan.group.world_size,
        "metadata": plan.metadata,
        "common": plan.common,
        "tensors": tensors,
        "versions": {"mtl_ckpt": __version__, "torch": torch.__version__, "tensorstore": importlib.metadata.version("tensorstore")},
    }


def _commit(plan: SavePlan, written: list[dict[str, Any]]) -> None:
    manifest = _manifest(plan, written)
    directory.write_json_atomically(os.path.join(plan.partial_dir, directory.METADATA_FILE), manifest)
    directory.commit(plan.ckpt_dir, plan.iteration)


def finalize_save(plan: SavePlan, written: list[dict[str, Any]] | None, write_error: str | None) -> None:
    """Phase 3 (collective): gather every rank's written shards; rank 0 commits."""
    gathered = plan.group.all_gather_object((written, write_error))
    failed = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failed[:4])
        raise CheckpointError(
            f"checkpoint save of iteration {plan.iteration} failed while writing shards ({detail}); "
            f"{plan.partial_dir} is left uncommitted and the previous checkpoint is untouched"
        )
    error = None
    if plan.group.is_coordinator:
        all_written = [entry for rank_written, _ in gathered for entry in rank_written]
        _, error = _attempt(lambda: _commit(plan, all_written))
    # after this, every rank sees the committed iteration (or every rank raises)
    plan.group.agree_on_failures(error, f"committing iteration {plan.iteration}")


def save(
    state: Any, ckpt_dir: str, iteration: int, metadata: dict[str, Any] | None = None, process_group: Any = None
) -> str:
    """Save a sharded state dict as ``ckpt_dir/iter_{iteration:07d}``; collective over the
    group (a plain call without torch.distributed). Returns the committed directory."""
    plan = prepare_save(state, ckpt_dir, iteration, metadata if metadata is not None else {}, process_group)
    _, error = _attempt(lambda: plan.snapshot(copy=False))
    written = None
    if error is None:
        written, error = _attempt(lambda: write_shards(plan))
    finalize_save(plan, written, error)
    return directory.iteration_dir(plan.ckpt_dir, iteration)
