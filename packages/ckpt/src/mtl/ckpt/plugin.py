"""Registers the ``zarr`` checkpoint format (entry point ``zarr_format`` in group ``mtl``)."""

from __future__ import annotations

from mtl.ckpt.load import load
from mtl.ckpt.save import save
from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import CheckpointFormat


@hookimpl
def mtl_checkpoint_formats() -> list[CheckpointFormat]:
    return [
        CheckpointFormat(
            "zarr",
            save=save,
            load=load,
            description="sharded zarr v3 arrays via tensorstore; atomic commit; resharding load",
        )
    ]
