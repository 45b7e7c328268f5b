"""``mtl train CONFIG [--set k=v ...] [--dry-run]``."""

from __future__ import annotations

import click

from mtl.core.config_io import load_config


@click.command()
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a config value (parsed as TOML, else a string). Repeatable.")
@click.option("--dry-run", is_flag=True, help="Print the resolved config, model tree, FLOPs and memory; exit.")
def train(config, overrides, dry_run):
    """Train a model described by the TOML file CONFIG (under torchrun for several processes)."""
    cfg = load_config(config, overrides)
    if dry_run:
        from mtl.cli.dry_run import dry_run as show

        click.echo(show(cfg))
        return
    from mtl.train.loop import train as run_training

    result = run_training(cfg)
    if result.stopped_by != "iters":
        click.echo(f"stopped at iteration {result.final_iteration} ({result.stopped_by})")
