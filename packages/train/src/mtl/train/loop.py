"""``train(config)``: one training run (``trainer.Trainer``): steps, logging and progress,
evaluation, checkpoints (every ``ckpt.interval`` steps or ``ckpt.interval_minutes``, at the end,
at ``train.exit_interval``, on SIGTERM/SIGINT), resume by default (``resume.py``), and NaN/Inf
steps stopped (or skipped) with their origin."""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.train.trainer import TrainResult, Trainer, evaluate

__all__ = ["TrainResult", "Trainer", "evaluate", "train"]


def train(config: RunConfig, progress: bool = True) -> TrainResult:
    """Train ``config`` to ``train.iters`` (or until ``train.exit_interval`` or a stop signal);
    ``progress`` allows the live progress display on an interactive terminal."""
    return Trainer(config, progress=progress).train()
