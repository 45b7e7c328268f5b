"""``mtl train CONFIG [--set k=v ...] [--fresh] [--nproc-per-node N [--max-restarts R]] [--dry-run]``."""

from __future__ import annotations

import click

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError

CONFIG_REFERENCE = "docs/config.md"


@click.command(epilog=f"Config reference (every key, its default and meaning): {CONFIG_REFERENCE} in the mtl "
                      "source tree; `mtl train CONFIG --dry-run` prints the resolved values.")
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a config value (parsed as TOML, else a string). Repeatable.")
@click.option("--fresh", is_flag=True,
              help="Start over instead of resuming from ckpt.save (ckpt.resume = false); only into an empty "
                   "ckpt.save directory.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None, metavar="N",
              help="Start N processes on this machine under torchrun, after checking the config once at "
                   "world size N here (a config error starts nothing and is never restarted).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None, metavar="R",
              help="With --nproc-per-node: torchrun restarts the processes up to R times after a failure "
                   "(each restart resumes from ckpt.save) [default: 0].")
@click.option("--dry-run", is_flag=True,
              help="Print a summary (model, parameters, FLOPs, layout, memory), the model tree and the resolved "
                   "config; exit.")
def train(config, overrides, fresh, nproc_per_node, max_restarts, dry_run):
    """Train a model described by the TOML file CONFIG (under torchrun for several processes).

    When ckpt.save already holds this run's checkpoints, the run resumes from the latest one
    (so the same command continues a stopped run, and torchrun --max-restarts restarts a
    failed one). Ctrl-C (SIGINT) or SIGTERM stops after the current step and saves, then exits
    130 or 143 (128 + the signal's number); a second Ctrl-C aborts at once (exit 1).

    --nproc-per-node N checks the config at world size N, then runs `torchrun --standalone
    --nproc-per-node N --max-restarts R -m mtl.cli train CONFIG ...` in its place (use torchrun
    itself for several machines)."""
    if max_restarts is not None and nproc_per_node is None:
        raise ConfigError("--max-restarts R needs --nproc-per-node N (the restarts are torchrun's)")
    cfg = load_config(config, [*overrides, *(["ckpt.resume=false"] if fresh else [])])
    if dry_run:
        from mtl.cli.dry_run import dry_run as show

        click.echo(show(cfg, world_size=nproc_per_node))
        return
    if nproc_per_node is not None:
        from mtl.cli.launch import check_launch, exec_torchrun, torchrun_argv

        check_launch(cfg, nproc_per_node)
        exec_torchrun(torchrun_argv(nproc_per_node, max_restarts or 0, config, list(overrides)))
    from mtl.cli.signal_exit import stopped_exit_code
    from mtl.train.loop import train as run_training

    result = run_training(cfg)
    _close_process_group()
    if result.stopped_by != "iters":
        click.echo(f"stopped at iteration {result.final_iteration} ({result.stopped_by})")
    if result.stopped_by == "signal":
        click.get_current_context().exit(stopped_exit_code(result.stop_signal))


def _close_process_group() -> None:
    """Take the process group down once the run has finished, on every rank.

    Left to the interpreter's exit, the group's threads were torn down while still running, and
    a rank could abort after a run that succeeded ("terminate called without an active
    exception", SIGABRT, and torchrun's ChildFailedError). The barrier first: no rank closes its
    connections while another still finishes the run's last collective. Only after a
    finished run: after an error, a peer may never reach the barrier."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
