"""``mtl ckpt inspect DIR``: metadata, model config and tensors of a checkpoint, read with zarr-python."""

from __future__ import annotations

import json
import math

import click


@click.group()
def ckpt():
    """Checkpoint tools."""


@ckpt.command()
@click.argument("directory", type=click.Path())
@click.option("--iteration", type=int, default=None)
def inspect(directory, iteration):
    """Show metadata, the model config and per-tensor statistics of a checkpoint (read
    without tensorstore)."""
    from mtl.ckpt import read_metadata
    from mtl.ckpt.inspect import inspect_checkpoint

    meta = read_metadata(directory, iteration)
    shown = {k: meta[k] for k in ("iteration", "consumed_samples", "versions") if k in meta}
    if "model" in meta.get("config", {}):  # the resolved [model] section the checkpoint was saved with
        shown["model"] = meta["config"]["model"]
    click.echo(json.dumps(shown, indent=1))
    rows = inspect_checkpoint(directory, iteration)
    width = max([len("key"), *(len(row["key"]) for row in rows)])
    click.echo(f"{'key':<{width}}  {'shape':<16} {'dtype':<9} {'shards':>6} "
               f"{'min':>11} {'max':>11} {'mean':>11} {'norm':>11}")
    for row in rows:
        shape = str(tuple(row["shape"]))
        click.echo(f"{row['key']:<{width}}  {shape:<16} {row['dtype']:<9} {row['shards']:>6} "
                   f"{row['min']:>11.4g} {row['max']:>11.4g} {row['mean']:>11.4g} {row['norm']:>11.4g}")
    click.echo(f"{len(rows)} tensors, {sum(math.prod(row['shape']) for row in rows):,} values")

