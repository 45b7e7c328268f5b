"""Resume policy: which checkpoint directory and iteration a run starts from, what it checks
before any compute, and what it reports when the saved config differs from this one.

The order of the sources (``starting_checkpoint``): this run's own ``ckpt.save``, then
``ckpt.load``, then ``ckpt.finetune_from``'s weights, then fresh weights. The iteration is
``ckpt.load_iteration`` when set (a committed one), else the one ``latest`` names, else (its
directory was deleted) the newest committed one, said in one warning. A ``ckpt.save`` that
holds another run's checkpoints (another model or data) is refused. Saving and loading the
state itself, in global shapes, is ``checkpointing.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mtl.ckpt import latest_iteration, read_metadata
from mtl.ckpt.directory import LATEST_FILE, committed_iterations, iteration_dir, write_latest
from mtl.core.config import RunConfig
from mtl.core.config_io import config_diff, config_from_dict
from mtl.core.errors import CheckpointError
from mtl.core.log import get_logger
from mtl.train.ranks import is_first_rank

log = get_logger(__name__)

# Keys that may change between a save and a resume without changing the model's numbers.
RESUMABLE_CHANGES = ("train.iters", "train.exit_interval", "train.eval_interval", "train.eval_iters",
                     "ckpt", "logging", "train.lr_decay_iters", "data.num_workers", "train.device")
# Derived from the layout (the padding of the vocabulary for tp): never stored, never compared.
LAYOUT_DERIVED = ("model.padded_vocab_size", "model.make_vocab_size_divisible_by")
# The data a run trains on: a ckpt.save directory holding another value belongs to another run.
RUN_DATA_KEYS = ("data.paths", "data.split", "data.tokenizer", "data.tokenizer_model", "data.dataset",
                 "data.mock_num_samples")
# What a fine-tuning start (ckpt.finetune_from) may change of the model it takes the weights from:
# its heads (a classifier in place of the pre-training heads; finetune_heads.py initialises what
# the checkpoint lacks), the sequence length (the position table keeps model.max_position_embeddings)
# and dropout, none of which changes a stored weight's shape.
FINETUNE_CHANGES = ("model.num_labels", "model.binary_head", "model.seq_length", "model.hidden_dropout",
                    "model.attention_dropout")
# The schedule's length: may change on resume (one warning line names it).
SCHEDULE_KEYS = ("train.iters", "train.lr_decay_iters", "train.warmup_iters")  # warmup: clamped to a short run


def _saved_config(saved: dict) -> RunConfig:
    config = config_from_dict(saved)
    config.resolved = True
    return config


def model_differences(saved: dict, config: RunConfig, finetune: bool = False) -> list[str]:
    """``model.*`` settings that differ between a saved config and ``config`` (the ones that
    change the model's numbers: not the backend, not the layout-derived padding; for a
    fine-tuning start, not ``FINETUNE_CHANGES``)."""
    ignore = LAYOUT_DERIVED + (FINETUNE_CHANGES if finetune else ())
    return [d for d in config_diff(_saved_config(saved), config, ignore=ignore)
            if d.startswith("model.") and not d.startswith("model.backend")]


def run_differences(saved: dict, config: RunConfig) -> list[str]:
    """What makes a saved config another run: a different model (``model_differences``) or
    different data (``RUN_DATA_KEYS``). A ``ckpt.save`` directory holds one run."""
    data = [d for d in config_diff(_saved_config(saved), config) if d.split(":")[0] in RUN_DATA_KEYS]
    return model_differences(saved, config) + data


def check_compatible(saved: dict, config: RunConfig, directory: str, iteration: int = 0,
                     finetune: bool = False) -> None:
    """Refuse a saved config of another model, naming every difference. A changed parallel
    layout is expected (every state reshards) and said in ``layout_change_note``'s one line; a
    changed schedule length is one warning; any other changed setting one warning each (rank 0).
    ``finetune`` (a ``ckpt.finetune_from`` start) allows ``FINETUNE_CHANGES`` and warns of nothing."""
    fatal = model_differences(saved, config, finetune)
    if fatal:
        raise CheckpointError(
            f"checkpoint {directory} was saved from a different model:\n  " + "\n  ".join(fatal)
            + "\nuse the same model settings, or start a new run without ckpt.load")
    if finetune or not is_first_rank():  # a fine-tuning run is a new run: its other settings are its own
        return
    schedule = []
    for line in config_diff(_saved_config(saved), config, ignore=LAYOUT_DERIVED):
        if line.split(":")[0] in SCHEDULE_KEYS:
            schedule.append(line)
        elif not line.startswith((*RESUMABLE_CHANGES, "model.", "parallel.")):
            log.warning("resuming %s with a changed setting: %s", directory, line)
    if schedule and iteration:
        log.warning("the schedule changed since iteration %d was saved (%s): the learning rate follows the new "
                    "length from here on", iteration, "; ".join(schedule))


def has_checkpoint(directory: str | None) -> bool:
    return bool(directory) and os.path.isfile(os.path.join(directory, LATEST_FILE))


def holds_checkpoints(directory: str | None) -> bool:
    """A ``latest`` file or any committed ``iter_*`` directory (what a fresh start must not mix with)."""
    if not directory or not os.path.isdir(directory):
        return False
    return has_checkpoint(directory) or bool(committed_iterations(directory))


@dataclass(frozen=True)
class Start:
    """Where a run's state comes from: ``directory`` (None: fresh weights) and its committed
    ``iteration``, the config key that named it, and whether the optimizer, iteration and
    data position come too."""

    directory: str | None
    key: str | None
    full_resume: bool
    iteration: int | None = None

    @property
    def path(self) -> str:
        """The iteration's own directory."""
        return iteration_dir(self.directory, self.iteration)


def _source(config: RunConfig) -> tuple[str | None, str | None, bool]:
    c = config.ckpt
    if c.resume and has_checkpoint(c.save):
        return c.save, "ckpt.save", True
    if c.load and (has_checkpoint(c.load) or not c.finetune_from):
        return c.load, "ckpt.load", c.load_optimizer
    if c.finetune_from:
        return c.finetune_from, "ckpt.finetune_from", False
    return None, None, False


def starting_checkpoint(config: RunConfig) -> Start:
    """Where this run starts from, in order:

    1. ``ckpt.save`` holding a checkpoint, with ``ckpt.resume`` (the default): this run's own
       save, in full (what a rerun of the same command, or torchrun's restart, needs);
    2. ``ckpt.load`` holding a checkpoint: resumed (weights only with ``ckpt.load_optimizer =
       false``);
    3. ``ckpt.finetune_from``: its weights, iteration 0;
    4. nothing: fresh weights.

    The iteration is ``ckpt.load_iteration`` where set, else the latest (``starting_iteration``)."""
    directory, key, full_resume = _source(config)
    if directory is None:
        if config.ckpt.load_iteration is not None:
            raise CheckpointError(
                f"ckpt.load_iteration = {config.ckpt.load_iteration}, but there is no checkpoint to start from "
                "(ckpt.save holds none; ckpt.load and ckpt.finetune_from are unset); unset ckpt.load_iteration")
        return Start(None, None, False)
    return Start(directory, key, full_resume, starting_iteration(directory, key, config.ckpt.load_iteration))


def starting_iteration(directory: str, key: str, requested: int | None) -> int:
    """``requested`` (``ckpt.load_iteration``) if it is a committed iteration of ``directory``;
    without it the one ``latest`` names, or, where that iteration's directory is gone (deleted
    as bad, say), the newest committed one, with one warning."""
    if not os.path.isdir(directory):
        latest_iteration(directory)  # raises, naming the missing directory
    committed = committed_iterations(directory)
    if requested is not None:
        if requested not in committed:
            raise CheckpointError(
                f"ckpt.load_iteration = {requested} is not a committed checkpoint in {key} = {directory} "
                f"(committed: {committed or 'none'}); choose one of those")
        return requested
    try:
        latest = latest_iteration(directory)
    except CheckpointError as exc:  # 'latest' missing or garbled
        if not committed:
            raise
        raise CheckpointError(f"{exc}\nset ckpt.load_iteration = N to start from one of {key} = {directory}'s "
                              f"committed iterations ({committed})") from exc
    if latest in committed:
        return latest
    if not committed:
        raise CheckpointError(
            f"{directory}/{LATEST_FILE} names iteration {latest}, but no iteration is committed in {directory}; "
            f"remove {directory} to start over, or set {key} to another directory")
    if is_first_rank():
        log.warning("%s/%s names iteration %d, which is not a committed checkpoint (its directory is gone): "
                    "starting from the newest committed one, iteration %d", directory, LATEST_FILE, latest,
                    committed[-1])
    return committed[-1]


def another_iteration_hint(start: Start) -> str:
    """How to start from another committed iteration than ``start``'s (a damaged one, say)."""
    others = [it for it in committed_iterations(start.directory) if it != start.iteration]
    return (f"to start from another committed iteration of {start.key} = {start.directory} "
            f"(committed: {others or 'none other'}), set ckpt.load_iteration = N")


def read_start(start: Start, read, *args, **kwargs):
    """``read(*args, **kwargs)`` on the starting checkpoint; an error reading it (a damaged
    iteration, say) also says how to start from another one."""
    try:
        return read(*args, **kwargs)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}\n{another_iteration_hint(start)}") from exc


def start_metadata(start: Start) -> dict:
    """The metadata of the iteration a run starts from."""
    return read_start(start, read_metadata, start.directory, start.iteration)


def check_checkpoint_dirs(config: RunConfig) -> Start:
    """Before any compute: the checkpoint a run starts from must hold this model, and the
    directory it saves into only this run (same model and data): another run's directory is
    refused with the differences named. ``ckpt.resume = false`` needs an empty ``ckpt.save``.
    Returns where the run starts from (``starting_checkpoint``)."""
    c = config.ckpt
    if not c.resume and holds_checkpoints(c.save):
        latest = f"latest iteration {latest_iteration(c.save)}" if has_checkpoint(c.save) else "no 'latest'"
        raise CheckpointError(
            f"ckpt.save = {c.save} already holds checkpoints ({latest}); ckpt.resume = false (mtl train --fresh) "
            f"starts over only into an empty directory: remove it, or set ckpt.save to a new directory "
            f"(without --fresh the run resumes from it)")
    start = starting_checkpoint(config)
    if start.directory is not None and start.key != "ckpt.save":
        differences = model_differences(start_metadata(start)["config"], config, start.key == "ckpt.finetune_from")
        if differences:
            raise CheckpointError(
                f"{start.key} = {start.directory} holds checkpoints of a different model:\n  "
                + "\n  ".join(differences) + "\nuse the same model settings as the checkpoint")
    if start.key == "ckpt.save":
        _check_own_directory(config, start)
    return start


def _check_own_directory(config: RunConfig, start: Start) -> None:
    """``ckpt.save`` holds this run's checkpoints only (the same model and data)."""
    c = config.ckpt
    differences = run_differences(start_metadata(start)["config"], config)
    if differences:
        raise CheckpointError(
            f"ckpt.save = {c.save} holds checkpoints of another run (a different model or data):\n  "
            + "\n  ".join(differences)
            + f"\nsave into another directory (ckpt.save = NEW_DIR; ckpt.load = {c.save} starts it from these "
            f"weights), or remove {c.save}")


def roll_back_latest(config: RunConfig, start: Start) -> None:
    """Rank 0: where ``ckpt.load_iteration`` resumes ``ckpt.save`` before its latest, point
    ``latest`` at it. The later iterations are then what a crash between a rename and the
    update of ``latest`` leaves (``mtl.ckpt.save`` replaces them as this run saves over them),
    and a rerun without ``ckpt.load_iteration`` resumes this run, not the abandoned one."""
    if start.key != "ckpt.save" or config.ckpt.load_iteration is None or not is_first_rank():
        return
    later = [it for it in committed_iterations(start.directory) if it > start.iteration]
    try:
        current = latest_iteration(start.directory)
    except CheckpointError:  # a garbled 'latest': the chosen iteration replaces it
        current = None
    if current != start.iteration:
        write_latest(start.directory, start.iteration)
    if later:
        log.info("ckpt.load_iteration = %d: %s/%s names it now; the later iteration(s) %s are replaced as this "
                 "run saves over them", start.iteration, start.directory, LATEST_FILE, later)
