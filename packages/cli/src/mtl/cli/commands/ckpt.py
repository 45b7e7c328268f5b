"""``mtl ckpt inspect DIR``: tensors of a checkpoint, read with zarr-python."""

from __future__ import annotations

import json

import click


@click.group()
def ckpt():
    """Checkpoint tools."""


@ckpt.command()
@click.argument("directory", type=click.Path())
@click.option("--iteration", type=int, default=None)
def inspect(directory, iteration):
    """Show metadata and per-tensor statistics of a checkpoint (read without tensorstore)."""
    from mtl.ckpt import read_metadata
    from mtl.ckpt.inspect import inspect_checkpoint

    meta = read_metadata(directory, iteration)
    click.echo(json.dumps({k: meta[k] for k in ("iteration", "consumed_samples", "versions") if k in meta}, indent=1))
    for row in inspect_checkpoint(directory, iteration):
        click.echo(str(row))
