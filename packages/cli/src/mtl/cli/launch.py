"""``mtl train --nproc-per-node N``: check the run once, in this process, then start torchrun.

Under a bare ``torchrun --max-restarts R``, a config error is raised by every worker and the
agent restarts them R times, each restart failing the same way. Here the config is resolved at
world size N, the training settings, checkpoint directories and datasets are checked, and only a
run that passes starts: torchrun's own agent replaces this process (``python -m
torch.distributed.run --standalone``), so restarts, rendezvous and the exit status are its."""

from __future__ import annotations

import os
import sys

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.plugins import registry


def resolve_with_tokenizer(cfg: RunConfig, world_size: int):
    """The config as ``world_size`` processes resolve it, with the training settings checked as
    training checks them, and the tokenizer that gave it the vocabulary."""
    from mtl.train.validate import check_training_settings

    tokenizer = registry("tokenizer").get(cfg.data.tokenizer).build(cfg.data.tokenizer_model)
    resolved = cfg.resolve(world_size=world_size, tokenizer_vocab_size=tokenizer.vocab_size)
    check_training_settings(resolved)
    return resolved, tokenizer


def resolve_at(cfg: RunConfig, world_size: int) -> RunConfig:
    return resolve_with_tokenizer(cfg, world_size)[0]


def check_launch(cfg: RunConfig, nproc_per_node: int) -> None:
    """Raise the error every worker would raise before any compute: the config at this world
    size, the training settings, what ``ckpt.save``/``ckpt.load`` hold, and the datasets (a
    missing or malformed ``.bin/.idx`` file). Building the datasets here also writes their
    index cache once, which the workers then read instead of each building it."""
    from mtl.train.resume import check_checkpoint_dirs
    from mtl.train.setup import build_datasets

    if "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc-per-node starts torchrun, but this process already runs under it; "
                          "drop --nproc-per-node (torchrun's own --nproc-per-node sets the processes)")
    resolved, tokenizer = resolve_with_tokenizer(cfg, nproc_per_node)
    check_checkpoint_dirs(resolved)
    build_datasets(resolved, tokenizer)


def torchrun_argv(nproc_per_node: int, max_restarts: int, config: str | None, overrides: list[str]) -> list[str]:
    """The torchrun command that runs ``mtl train CONFIG --set ...`` in each of the processes.
    ``ckpt.resume = true`` goes last: the check above found ``ckpt.save`` empty if --fresh (or
    ckpt.resume = false) was asked for, so the first attempt starts afresh either way, and a
    restart then resumes from this run's checkpoints instead of refusing its own directory."""
    worker = ["-m", "mtl.cli", "train", *([config] if config else [])]
    for override in [*overrides, "ckpt.resume=true"]:
        worker += ["--set", override]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", str(max_restarts), *worker]


def exec_torchrun(argv: list[str]) -> None:
    """Replace this process with torchrun's agent (its exit status becomes ``mtl``'s)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
