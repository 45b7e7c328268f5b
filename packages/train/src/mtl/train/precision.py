"""Mixed precision: parameters stay fp32; the forward runs under autocast in bf16 or fp16.

fp16 needs dynamic loss scaling: the loss is multiplied by ``scale`` before backward, the
gradients divided by it after; an overflow anywhere skips the step and halves the scale,
and ``growth_interval`` clean steps double it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mtl.core.config import TrainConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device, cache_enabled: bool = True):
    """The forward's autocast; ``cache_enabled=False`` for a CUDA graph capture, which cannot
    keep autocast's cast weights (with bf16/fp16 weights there is nothing to cache anyway)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision], cache_enabled=cache_enabled)


@dataclass
class LossScaler:
    scale: float = 1.0
    growth_interval: int = 1000
    min_scale: float = 1.0
    dynamic: bool = False
    clean_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def for_config(cls, t: TrainConfig) -> "LossScaler":
        if t.precision != "fp16":
            return cls()
        return cls(
            scale=t.initial_loss_scale,
            growth_interval=t.loss_scale_window,
            min_scale=t.min_loss_scale,
            dynamic=True,
        )

    def update(self, found_inf: bool) -> bool:
        """Record the step's outcome; returns True when the optimizer step must be skipped."""
        if not self.dynamic:
            return found_inf
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale = max(self.scale / 2.0, self.min_scale)
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
