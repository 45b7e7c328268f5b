"""``load``: fill a template state with the slices it asks for, from any saved layout.

Each ``ShardedTensor`` of the template names a global key, offset and local shape; load
reads exactly that box of the stored array, whatever sharding wrote it, so a checkpoint
saved at tp=2 loads at tp=1 or tp=4: resharding is a load. Load is not collective: every
rank reads only what it needs.

With ``verify=True`` (default) load reads every stored shard that overlaps the box, checks
its sha256 against ``metadata.json`` and cuts the box out of them; with ``verify=False`` it
reads the box alone.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from mtl.ckpt import directory, storage
from mtl.ckpt.directory import latest_iteration, list_keys, read_manifest, read_metadata
from mtl.ckpt.sharded import ShardedTensor, flatten_state, merge_common
from mtl.core.errors import CheckpointError

__all__ = ["load", "latest_iteration", "read_metadata", "list_keys"]


def _overlap(a_off: list, a_shape: list, b_off: tuple, b_shape: tuple) -> tuple | None:
    """The intersection of two boxes as (start, stop) per dim, or None when they miss."""
    bounds = []
    for ao, asz, bo, bsz in zip(a_off, a_shape, b_off, b_shape):
        start, stop = max(ao, bo), min(ao + asz, bo + bsz)
        if start >= stop:
            return None
        bounds.append((start, stop))
    return tuple(bounds)


def _verified_shard(key: str, shard: dict[str, Any], data: np.ndarray) -> np.ndarray:
    """A whole stored shard as read, checked against its sha256 from metadata.json."""
    if storage.checksum(data) != shard["sha256"]:
        raise CheckpointError(
            f"tensor '{key}' shard at offset {shard['offset']} shape {shard['shape']} fails its "
            "checksum: the array data is corrupt or missing — load another iteration"
        )
    return data


def _shards_needed(entry: dict[str, Any], targets: list[ShardedTensor]) -> list[dict[str, Any]]:
    """The stored shards that any of this rank's boxes of one key overlaps."""
    if not entry["global_shape"]:  # a 0-d tensor is one shard
        return entry["shards"][:1]
    return [
        shard for shard in entry["shards"]
        if any(_overlap(shard["offset"], shard["shape"], t.global_offset, t.local_shape) for t in targets)
    ]


class _KeyReads:
    """One key's stored shards: each read started up front, then checked once on a worker
    thread (hashlib releases the GIL) while the caller copies the previous key. Several boxes
    of one key, as the pieces of a flat range, share the checked shards."""

    def __init__(self, array: Any, key: str, entry: dict[str, Any], targets: list[ShardedTensor],
                 workers: ThreadPoolExecutor):
        self.key, self.entry = key, entry
        self.checked = {}
        for shard in _shards_needed(entry, targets):
            offset, shape = tuple(shard["offset"]), tuple(shard["shape"])
            read = storage.start_read(array, offset, shape, key)
            self.checked[offset] = workers.submit(
                lambda shard=shard, read=read, offset=offset, shape=shape:
                _verified_shard(key, shard, storage.finish_read(read, offset, shape, key))
            )

    def shard(self, shard: dict[str, Any]) -> np.ndarray:
        return self.checked[tuple(shard["offset"])].result()

    def box(self, offset: tuple, shape: tuple) -> np.ndarray:
        """The box ``offset``/``shape`` cut out of every verified stored shard it overlaps."""
        if not shape:  # a 0-d tensor is its one shard
            return np.asarray(self.shard(self.entry["shards"][0])).reshape(())
        for shard in self.entry["shards"]:  # the box is one whole stored shard: no copy
            if tuple(shard["offset"]) == tuple(offset) and tuple(shard["shape"]) == tuple(shape):
                return self.shard(shard)
        out = np.empty(shape, dtype=np.dtype(self.entry["storage_dtype"]))
        filled = 0
        for shard in self.entry["shards"]:
            bounds = _overlap(shard["offset"], shard["shape"], offset, shape)
            if bounds is None:
                continue
            data = self.shard(shard)
            src = tuple(slice(lo - so, hi - so) for (lo, hi), so in zip(bounds, shard["offset"]))
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(bounds, offset))
            out[dst] = data[src]
            filled += int(np.prod([hi - lo for lo, hi in bounds]))
        if filled != out.size:
            raise CheckpointError(
                f"tensor '{self.key}': the stored shards cover {filled} of the {out.size} elements asked for at "
                f"offset {offset}; metadata.json is inconsistent — the checkpoint is corrupt"
            )
        return out


def _check_fits(key: str, entry: dict[str, Any], target: ShardedTensor, ckpt_path: str) -> None:
    stored_shape = tuple(entry["global_shape"])
    if stored_shape != target.global_shape:
        raise CheckpointError(
            f"tensor '{key}' has global shape {stored_shape} in {ckpt_path} but the model asks for "
            f"{target.global_shape}: a checkpoint from a different model shape (check hidden size, "
            "layers, vocab padding)"
        )


def load(
    template_state: Any,
    ckpt_dir: str,
    iteration: int | None = None,
    strict: bool = True,
    verify: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Load ``iteration`` (default: ``latest``) of ``ckpt_dir`` into ``template_state``.

    Every ``ShardedTensor``'s ``data`` is overwritten in place with its slice, cast to its
    dtype; plain values are replaced by the saved common state. Returns ``(state,
    metadata)``: the template structure with loaded values, and the metadata given to save.
    ``strict=False`` skips keys the checkpoint lacks (leaving the template's values).
    """
    iteration = directory.resolve_iteration(ckpt_dir, iteration)
    manifest = read_manifest(ckpt_dir, iteration)
    ckpt_path = directory.iteration_dir(ckpt_dir, iteration)
    stored = manifest["tensors"]
    targets = flatten_state(template_state)

    missing = [t.key for t in targets.values() if t.key not in stored]
    if missing and strict:
        present = sorted(stored)
        raise CheckpointError(
            f"tensor '{missing[0]}' (and {len(missing) - 1} more) is not in {ckpt_path}; it has "
            f"{len(present)} tensors, e.g. {present[:5]}; load with strict=False to skip missing keys"
        )
    wanted = [t for t in targets.values() if t.key in stored]
    for target in wanted:
        _check_fits(target.key, stored[target.key], target, ckpt_path)

    by_key: dict[str, list[ShardedTensor]] = {}
    for target in wanted:
        if target.data.numel() > 0:  # an empty box (a rank holding only padding) reads nothing
            by_key.setdefault(target.key, []).append(target)
    # Reads of the next key run on tensorstore's threads, and its checksums on worker threads,
    # while this key's boxes are copied into the targets.
    keys = list(by_key)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="mtl-ckpt-verify") as workers:

        def open_key(key: str):
            entry = stored[key]
            array = storage.open_array(os.path.join(ckpt_path, entry["path"]), key)
            return _KeyReads(array, key, entry, by_key[key], workers) if verify else array

        upcoming = open_key(keys[0]) if keys else None
        for i, key in enumerate(keys):
            current, upcoming = upcoming, open_key(keys[i + 1]) if i + 1 < len(keys) else None
            for target in by_key[key]:
                if verify:
                    words = current.box(target.global_offset, target.local_shape)
                else:
                    words = storage.read_region(current, target.global_offset, target.local_shape, key)
                loaded = storage.from_storage_array(words, stored[key]["dtype"])  # [local_shape], stored dtype
                with torch.no_grad():
                    target.data.copy_(loaded.to(target.data.dtype))

    state = merge_common(template_state, manifest["common"], strict)
    return state, manifest["metadata"]
