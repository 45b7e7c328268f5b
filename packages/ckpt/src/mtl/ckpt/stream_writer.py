"""``StreamingCheckpointWriter``: one process writes a checkpoint a tensor at a time.

``save`` needs every tensor of the state alive at once (each rank its shards). A converter
producing a model one tensor at a time (``mtl convert``) uses this instead: it writes each
tensor as it comes and keeps only its checksums, then commits the same directory layout and
``metadata.json`` that ``save`` writes, so ``load`` (with ``verify=True``) reads it at any layout.

    writer = StreamingCheckpointWriter(ckpt_dir, iteration=0, metadata={...})
    for key, tensor in tensors:
        writer.write(key, tensor, chunk_shape=...)  # e.g. one TP rank's slice
    writer.commit()

Each chunk of the grid is recorded as one shard with its own sha256, so a rank that loads one
chunk reads and verifies that chunk alone. Nothing is visible before ``commit``: the tensors
go to ``iter_N.partial``, renamed to ``iter_N`` (and ``latest`` updated) at the end.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import os
from typing import Any

import torch

from mtl.ckpt import __version__, directory, storage
from mtl.core.errors import CheckpointError

__all__ = ["StreamingCheckpointWriter"]


class StreamingCheckpointWriter:
    def __init__(self, ckpt_dir: str, iteration: int, metadata: dict[str, Any] | None = None, common: Any = None):
        if not isinstance(iteration, int) or iteration < 0:
            raise CheckpointError(f"StreamingCheckpointWriter(iteration={iteration!r}): the iteration must be an int >= 0")
        self.ckpt_dir = os.path.abspath(str(ckpt_dir))
        self.iteration = iteration
        self.metadata = metadata if metadata is not None else {}
        self.common = common if common is not None else {}
        for name, value in (("metadata", self.metadata), ("common state", self.common)):
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {name} is not JSON-able ({exc}); store numbers, strings, lists and dicts") from exc
        self.tensors: dict[str, dict[str, Any]] = {}
        self.committed = False
        final = directory.iteration_dir(self.ckpt_dir, iteration)
        if os.path.exists(final):
            raise CheckpointError(
                f"iteration {iteration} is already committed at {final}; write under a new iteration or "
                "delete that directory first"
            )
        self.partial_dir = directory.partial_dir(self.ckpt_dir, iteration)
        directory.create_partial(self.partial_dir)

    def write(self, key: str, tensor: torch.Tensor, chunk_shape: tuple[int, ...] | None = None) -> None:
        """Write the whole global tensor ``key``, chunked by ``chunk_shape`` (default: one chunk)."""
        if self.committed:
            raise CheckpointError(f"write('{key}') after commit(); start a new writer for another iteration")
        if key in self.tensors:
            raise CheckpointError(f"tensor '{key}' was already written to {self.partial_dir}; each key is written once")
        if not isinstance(key, str) or not key.strip(".") or "\\" in key:
            raise CheckpointError(f"tensor key {key!r} is not usable: give a non-empty name such as 'model.layers.0.x'")
        shape = tuple(tensor.shape)
        chunk = tuple(max(1, n) for n in shape) if chunk_shape is None else tuple(int(n) for n in chunk_shape)
        if len(chunk) != len(shape) or any(n < 1 for n in chunk):
            raise CheckpointError(
                f"tensor '{key}': chunk_shape {chunk_shape} does not fit shape {shape} (one positive size per dim)"
            )
        logical = storage.dtype_name(tensor.dtype)
        relpath = os.path.join(directory.ARRAYS_DIR, storage.array_dirname(key))
        path = os.path.join(self.partial_dir, relpath)
        storage.create_array(path, shape, chunk, logical)
        array = storage.open_array(path, key)
        data = storage.to_storage_array(tensor.detach().cpu())
        shards, pending = [], []
        # one shard per chunk of the grid (the last one along a dim may be partial); the writes
        # run on tensorstore's threads while this one hashes the same boxes

        starts = [range(0, n, c) if n else [0] for n, c in zip(shape, chunk)]
        for offset in itertools.product(*starts):
            box_shape = tuple(min(c, n - o) for o, c, n in zip(offset, chunk, shape))
            box = data[tuple(slice(o, o + s) for o, s in zip(offset, box_shape))]
            pending.append(storage.start_write(array, offset, box))
            shards.append({"offset": list(offset), "shape": list(box_shape), "sha256": storage.checksum(box)})
        for future in pending:
            storage.finish_write(future)
        self.tensors[key] = {
            "path": relpath,
            "global_shape": list(shape),
            "dtype": logical,
            "storage_dtype": storage.storage_dtype(logical),
            "chunk_shape": list(chunk),
            "shards": shards,
        }

    def commit(self) -> str:
        """Write ``metadata.json``, rename ``iter_N.partial`` to ``iter_N`` and update ``latest``;
        returns the committed directory."""
        if self.committed:
            raise CheckpointError(f"iteration {self.iteration} in {self.ckpt_dir} is already committed")
        manifest = {
            "format": directory.FORMAT_NAME,
            "format_version": directory.FORMAT_VERSION,
            "iteration": self.iteration,
            "world_size": 1,
            "metadata": self.metadata,
            "common": self.common,
            "tensors": self.tensors,
            "versions": {"mtl_ckpt": __version__, "torch": torch.__version__,
                         "tensorstore": importlib.metadata.version("tensorstore")},
        }
        directory.write_json_atomically(os.path.join(self.partial_dir, directory.METADATA_FILE), manifest)
        directory.commit(self.ckpt_dir, self.iteration)
        self.committed = True
        return directory.iteration_dir(self.ckpt_dir, self.iteration)
