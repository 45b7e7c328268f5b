"""Learning-rate schedules: linear warmup, then constant, linear, cosine or WSD decay.

The rate is a pure function of the iteration, so resuming needs no scheduler state."""

from __future__ import annotations

import math

from mtl.core.config import TrainConfig


def learning_rate(t: TrainConfig, iteration: int) -> float:
    """LR for ``iteration`` (0-based: the step about to be taken)."""
    step = iteration + 1
    if t.warmup_iters and step <= t.warmup_iters:
        return t.lr * step / t.warmup_iters
    decay_steps = max(t.lr_decay_iters - t.warmup_iters, 1)
    progress = min(max(step - t.warmup_iters, 0) / decay_steps, 1.0)
    if t.lr_schedule == "constant":
        return t.lr
    if t.lr_schedule == "linear":
        return t.min_lr + (t.lr - t.min_lr) * (1.0 - progress)
    if t.lr_schedule == "cosine":
        return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # WSD (warmup-stable-decay): hold the peak, then anneal linearly over the final fraction.
    stable = 1.0 - t.wsd_decay_fraction
    if progress <= stable:
        return t.lr
    anneal = (progress - stable) / max(t.wsd_decay_fraction, 1e-12)
    return t.min_lr + (t.lr - t.min_lr) * (1.0 - anneal)
