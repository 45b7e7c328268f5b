"""``mtl plugins``: installed distributions, their versions, and what each registers."""

from __future__ import annotations

import importlib.metadata

import click

from mtl.core.plugins import installed_distributions


@click.command()
def plugins():
    """List installed mtl distributions and what each registers."""
    rows = installed_distributions()
    registering = {dist for dist, _, _ in rows}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["name"]
        if name and name.startswith("mtl-") and name not in registering:
            rows.append((name, dist.version, {}))
    for dist, version, kinds in sorted(rows):
        click.echo(f"{dist} {version}")
        for kind, names in kinds.items():
            click.echo(f"  {kind}: {', '.join(names)}")
