"""Sharded, reshardable checkpoints: one zarr v3 array per tensor, written through tensorstore.

    from mtl.ckpt import ShardedTensor, save, load, AsyncSaver, latest_iteration
"""

__version__ = "0.1.0"

from mtl.ckpt.async_save import AsyncSaver  # noqa: E402
from mtl.ckpt.directory import latest_iteration, list_keys, read_metadata  # noqa: E402
from mtl.ckpt.load import load  # noqa: E402
from mtl.ckpt.retention import prune_checkpoints  # noqa: E402
from mtl.ckpt.save import save  # noqa: E402
from mtl.ckpt.sharded import ShardedTensor, flatten_state  # noqa: E402

__all__ = [
    "AsyncSaver",
    "ShardedTensor",
    "flatten_state",
    "latest_iteration",
    "list_keys",
    "load",
    "prune_checkpoints",
    "read_metadata",
    "save",
]
