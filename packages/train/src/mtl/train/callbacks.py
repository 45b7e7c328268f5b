"""Metric sinks, registered as train callbacks: JSONL (always on by default) and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError


class JsonlSink:
    """Appends one JSON object per logged step to ``<logging.dir>/metrics.jsonl``."""

    def __init__(self, config: RunConfig):
        directory = Path(config.logging.dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: readable while training

    def on_step(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def on_eval(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, config: RunConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "logging.tensorboard = true needs the tensorboard package: pip install 'mtl-train[tensorboard]'"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(Path(config.logging.dir) / "tensorboard"))

    def on_step(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"train/{key}", value, step)

    def on_eval(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"eval/{key}", value, step)

    def close(self) -> None:
        self._writer.close()
