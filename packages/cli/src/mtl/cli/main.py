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


class MtlCommandError(click.ClickException):
    """An :class:`MtlError` as click shows it: one line, ``error: ...``, exit status 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.secho(f"error: {self.format_message()}", fg="red", err=True, file=file)


class MtlGroup(click.Group):
    """Adds plugin commands lazily, so a broken plugin cannot break ``mtl --help``'s built-ins,
    and turns :class:`MtlError` into a one-line message (a traceback only with ``--debug``),
    whether ``mtl`` runs as a script or is invoked in-process (``click.testing.CliRunner``).

    Loading the plugins imports every installed family and backend, and with them torch
    (seconds), so ``mtl --help`` lists plugin commands only when the plugins are loaded
    already; a name that is not built in loads them to look it up, and ``mtl plugins`` lists
    every plugin command."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MtlError as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            raise MtlCommandError(str(exc)) from exc

    def _plugin_commands(self) -> dict:
        from mtl.core.plugins import registry

        try:
            return {name: entry.value.command for name, entry in registry("cli command").entries().items()}
        except MtlError:
            return {}

    def list_commands(self, ctx):
        from mtl.core import plugins

        loaded = plugins.plugins_loaded()
        return sorted(set(super().list_commands(ctx)) | (set(self._plugin_commands()) if loaded else set()))

    def get_command(self, ctx, name):
        return super().get_command(ctx, name) or self._plugin_commands().get(name)


@click.group(cls=MtlGroup)
@click.option("--debug", is_flag=True, help="Show full tracebacks for mtl errors.")
@click.version_option(package_name="mtl-cli")
@click.pass_context
def cli(ctx, debug):
    """mtl: large-scale transformer training.

    Installed plugins may add commands: `mtl plugins` lists them (as "cli command")."""
    ctx.obj = {"debug": debug}


for command in (train, preprocess, generate, convert, plugins, ckpt, demo):
    cli.add_command(command)


def main(argv=None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="mtl", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    # standalone_mode=False returns the exit code of ``--help``/``--version`` style exits
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
