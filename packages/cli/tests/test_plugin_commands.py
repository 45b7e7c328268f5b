"""Commands contributed through the ``mtl_cli_commands`` hook join the ``mtl`` group."""

import click
import pytest

from mtl.core.errors import DataError
from mtl.core.hookspecs import hookimpl
from mtl.core.plugins import register_plugin, unregister_plugin
from mtl.core.registrations import CliCommand


@click.command()
@click.option("--name", default="world")
def hello(name):
    """Say hello (a plugin command)."""
    click.echo(f"hello, {name}")


@click.command()
def broken():
    """Fail the way mtl commands fail."""
    raise DataError("broken.jsonl is not a corpus")


class CommandsPlugin:
    @hookimpl
    def mtl_cli_commands(self):
        return [CliCommand("hello", hello, "greets"), CliCommand("broken", broken)]


@pytest.fixture
def plugin():
    instance = CommandsPlugin()
    register_plugin(instance, name="test-commands")
    yield instance
    unregister_plugin(instance)


def test_plugin_commands_are_listed_and_run(mtl, ok, clean_error, plugin):
    assert "hello" in ok(mtl("--help")) and "broken" in ok(mtl("--help"))
    assert ok(mtl("hello", "--name", "mtl")) == "hello, mtl\n"
    clean_error(mtl("broken"), "broken.jsonl is not a corpus")
    out = ok(mtl("plugins"))
    assert "cli command: broken, hello" in out
    assert "hello" not in ok(mtl("--help")).split("Commands:")[0]


def test_plugin_commands_go_away_with_the_plugin(mtl, ok):
    plugin = CommandsPlugin()
    register_plugin(plugin, name="test-commands")
    assert ok(mtl("hello")) == "hello, world\n"
    unregister_plugin(plugin)
    result = mtl("hello")
    assert result.exit_code == 2 and "No such command 'hello'" in result.output


def test_top_level_help_does_not_import_torch():
    """``mtl --help`` lists the built-in commands without loading the plugins (which import
    torch: seconds); a plugin command is found when it is invoked."""
    import subprocess
    import sys

    probe = ("import sys\nfrom mtl.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "plugins" in result.stdout
    assert result.stdout.strip().endswith("torch not imported"), result.stdout
