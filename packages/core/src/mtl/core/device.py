"""A ``--device`` option as a torch device that exists on this machine (shared by the commands
that load a model: generate, serve)."""

from __future__ import annotations

import torch

from mtl.core.errors import ConfigError


def parse_device(device: str) -> torch.device:
    """``device`` as a torch device that exists here, else a ConfigError naming the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device!r}: CUDA is not available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev
