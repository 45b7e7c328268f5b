"""Settings the config's ``resolve`` leaves to the trainer, checked before any work (also by
``mtl train --dry-run``): the optimizer's and the checkpoint schedule's. Each error names the
key, the value and what would be accepted."""

from __future__ import annotations

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError


def check_training_settings(config: RunConfig) -> None:
    t, c = config.train, config.ckpt
    problems = []
    if t.lr < 0:
        problems.append(f"train.lr = {t.lr} must not be negative")
    if t.min_lr < 0 or t.min_lr > t.lr:
        problems.append(f"train.min_lr = {t.min_lr} must be between 0 and train.lr = {t.lr}")
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(t, key)
        if not 0.0 <= value < 1.0:
            problems.append(f"train.{key} = {value} must be in [0, 1) (AdamW's moment decay; typical 0.9 / 0.95)")
    if t.adam_eps <= 0:
        problems.append(f"train.adam_eps = {t.adam_eps} must be positive (typical 1e-8)")
    if t.weight_decay < 0:
        problems.append(f"train.weight_decay = {t.weight_decay} must not be negative")
    if t.clip_grad < 0:
        problems.append(f"train.clip_grad = {t.clip_grad} must not be negative (0: no clipping)")
    if t.precision == "fp16":
        if t.initial_loss_scale <= 0 or t.min_loss_scale <= 0:
            problems.append(f"train.initial_loss_scale = {t.initial_loss_scale} and train.min_loss_scale = "
                            f"{t.min_loss_scale} must be positive")
        if t.loss_scale_window < 1:
            problems.append(f"train.loss_scale_window = {t.loss_scale_window} must be at least 1")
    if c.interval < 0 or c.keep_last < 0:
        problems.append(f"ckpt.interval = {c.interval} and ckpt.keep_last = {c.keep_last} must not be negative (0: off)")
    if c.interval_minutes < 0:
        problems.append(f"ckpt.interval_minutes = {c.interval_minutes} must not be negative (0: off)")
    if problems:
        raise ConfigError("; ".join(problems))
