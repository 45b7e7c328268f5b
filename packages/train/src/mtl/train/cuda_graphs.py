"""``train.cuda_graphs``: the training step captures the model's layers before its first
micro-batch (the family's ``capture_cuda_graphs``, e.g. mtl.models.gpt.cuda_graphs), and the
model replays them from then on; before every later step the family checks that nothing the
graphs read has moved. Captured lazily, in the step, so that a checkpoint loaded after setup
is in place and the capture's warm-up gradients are zeroed with the step's."""

from __future__ import annotations

import torch

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.train.precision import autocast


def capture_or_check(config: RunConfig, chunks: list, device: torch.device) -> None:
    """Capture each model chunk's layers on its first training step, under the forward's
    autocast, as the step runs them; on later steps the family checks that nothing the graphs
    read has moved."""
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)  # inside the DataParallel wrapper
        capture = getattr(model, "capture_cuda_graphs", None)
        if capture is None:
            raise ConfigError(
                f"train.cuda_graphs = true: model.family = '{config.model.family}' cannot capture its layers "
                "(no capture_cuda_graphs); set train.cuda_graphs = false"
            )
        with autocast(config.train.precision, device, cache_enabled=False):
            capture(config.train.micro_batch_size)
