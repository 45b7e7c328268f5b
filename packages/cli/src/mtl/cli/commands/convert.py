"""``mtl convert --from hf --to mtl SRC DST`` and back."""

from __future__ import annotations

import click

from mtl.core.errors import ConfigError


@click.command()
@click.option("--from", "src_format", required=True, type=click.Choice(["hf", "mtl"]))
@click.option("--to", "dst_format", required=True, type=click.Choice(["hf", "mtl"]))
@click.option("--family", default=None,
              help="Model family whose converter to use [hf -> mtl: gpt; mtl -> hf: the checkpoint's].")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
def convert(src_format, dst_format, family, src, dst):
    """Convert a checkpoint between formats (tokenizer files are carried along)."""
    from mtl.cli.conversion import hf_to_mtl, mtl_to_hf

    if (src_format, dst_format) == ("hf", "mtl"):
        hf_to_mtl(src, dst, family or "gpt")
    elif (src_format, dst_format) == ("mtl", "hf"):
        mtl_to_hf(src, dst, family)
    else:
        raise ConfigError(f"cannot convert from {src_format} to {dst_format}; use hf -> mtl or mtl -> hf")
    click.echo(f"converted {src} ({src_format}) -> {dst} ({dst_format})")
