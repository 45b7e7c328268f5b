"""Summaries of a checkpoint read with zarr-python, without tensorstore (``mtl ckpt inspect``).

Needs the ``inspect`` extra: ``pip install 'mtl-ckpt[inspect]'`` (zarr>=3, Python >= 3.11).
Raw-word arrays (bf16, fp8) are decoded through torch using the logical dtype kept in the
array's ``mtl_logical_dtype`` attribute.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from mtl.ckpt import directory, storage
from mtl.core.errors import CheckpointError, NotInstalledError


def _zarr() -> Any:
    try:
        import zarr
    except ImportError as exc:
        raise NotInstalledError("inspecting checkpoints needs zarr-python: pip install 'mtl-ckpt[inspect]'") from exc
    return zarr


def read_array(ckpt_dir: str, key: str, iteration: int | None = None) -> torch.Tensor:
    """The whole global tensor ``key`` as stored, decoded to its logical dtype, via zarr-python."""
    zarr = _zarr()
    iteration = directory.resolve_iteration(ckpt_dir, iteration)
    entry = directory.read_manifest(ckpt_dir, iteration)["tensors"].get(key)
    if entry is None:
        keys = directory.list_keys(ckpt_dir, iteration)
        raise CheckpointError(f"tensor '{key}' is not in iteration {iteration} of {ckpt_dir}; it has e.g. {keys[:5]}")
    array = zarr.open_array(store=os.path.join(directory.iteration_dir(ckpt_dir, iteration), entry["path"]), mode="r")
    logical = array.attrs.get(storage.LOGICAL_DTYPE_ATTR, entry["dtype"])
    return storage.from_storage_array(np.asarray(array[...]), logical)


def inspect_checkpoint(ckpt_dir: str, iteration: int | None = None) -> list[dict[str, Any]]:
    """One row per tensor: key, global shape, logical dtype, shard count, min/max/mean/norm."""
    iteration = directory.resolve_iteration(ckpt_dir, iteration)
    manifest = directory.read_manifest(ckpt_dir, iteration)
    rows = []
    for key in sorted(manifest["tensors"]):
        entry = manifest["tensors"][key]
        values = read_array(ckpt_dir, key, iteration).to(torch.float64)
        empty = values.numel() == 0
        rows.append(
            {
                "key": key,
                "shape": tuple(entry["global_shape"]),
                "dtype": entry["dtype"],
                "shards": len(entry["shards"]),
                "min": math.nan if empty else values.min().item(),
                "max": math.nan if empty else values.max().item(),
                "mean": math.nan if empty else values.mean().item(),
                "norm": 0.0 if empty else values.norm().item(),
            }
        )
    return rows
