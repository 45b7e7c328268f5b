"""The plugin: ``mtl serve`` joins the ``mtl`` command through ``mtl_cli_commands``."""

from mtl.core.hookspecs import hookimpl
from mtl.core.registrations import CliCommand


@hookimpl
def mtl_cli_commands():
    from mtl.serve.command import serve  # click only; the engine loads when the command runs

    return [CliCommand("serve", serve, "OpenAI-compatible HTTP server with continuous batching")]
