"""The ``mtl`` command: built-in commands plus those contributed through ``mtl_cli_commands``."""

from __future__ import annotations

import sys

import click

from mtl.cli.commands.ckpt import ckpt
from mtl.cli.commands.convert import convert
from mtl.cli.commands.demo import demo
from mtl.cli.commands.generate import generate
from mtl.cli.commands.plugins import plugins
from mtl.cli.commands.preprocess import preprocess
from mtl.cli.commands.train import train
from mtl.core.errors import MtlError


class MtlGroup(click.Group):
    """Adds plugin commands lazily, so a broken plugin cannot break ``mtl --help``'s built-ins."""

    def _plugin_commands(self) -> dict:
        from mtl.core.plugins import registry

        try:
            return {name: entry.value.command for name, entry in registry("cli command").entries().items()}
        except MtlError:
            return {}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._plugin_commands()))

    def get_command(self, ctx, name):
        return super().get_command(ctx, name) or self._plugin_commands().get(name)


@click.group(cls=MtlGroup)
@click.option("--debug", is_flag=True, help="Show full tracebacks for mtl errors.")
@click.version_option(package_name="mtl-cli")
@click.pass_context
def cli(ctx, debug):
    """mtl: large-scale transformer training."""
    ctx.obj = {"debug": debug}


for command in (train, preprocess, generate, convert, plugins, ckpt, demo):
    cli.add_command(command)


def main(argv=None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="mtl", standalone_mode=False)
    except MtlError as exc:
        if debug:
            raise
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
