"""``train.cuda_graphs``: the training step captures the model's layers before its first
micro-batch (the family's ``capture_cuda_graphs``, e.g. mtl.models.gpt.cuda_graphs) and, from
then on, the model replays them. Captured lazily, in the step, so that a checkpoint loaded
after setup is in place and the capture's warm-up gradients are zeroed with the step's."""

from __future__ import annotations

import torch

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.train.precision import autocast


def capture_once(config: RunConfig, chunks: list, device: torch.device) -> None:
    """Capture each model chunk's layers on its first training step (a no-op afterwards),
    under the forward's autocast, as the step runs them."""
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)  # inside the DataParallel wrapper
        if getattr(model, "_mtl_cuda_graphs_captured", False):
            continue
        capture = getattr(model, "capture_cuda_graphs", None)
        if capture is None:
            raise ConfigError(
                f"train.cuda_graphs = true: model.family = '{config.model.family}' cannot capture its layers "
                "(no capture_cuda_graphs); set train.cuda_graphs = false"
            )
        with autocast(config.train.precision, device, cache_enabled=False):
            capture(config.train.micro_batch_size)
        model._mtl_cuda_graphs_captured = True
