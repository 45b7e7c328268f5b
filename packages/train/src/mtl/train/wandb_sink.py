"""Weights & Biases as a train callback (``logging.wandb = true``, or ``"wandb"`` in
``logging.callbacks``), through the real ``wandb`` package. The W&B run id is kept in
``<logging.dir>/wandb_run_id``, so a resumed run (the same command again, a torchrun restart)
continues the same W&B run instead of starting another; ``logging.wandb_mode = "offline"``
(or ``WANDB_MODE``) writes locally for a later ``wandb sync``."""

from __future__ import annotations

import secrets
from pathlib import Path

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError

MODES = ("online", "offline", "disabled")


class WandbSink:
    def __init__(self, config: RunConfig):
        try:
            import wandb  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigError("logging.wandb = true needs the wandb package: pip install 'mtl-train[wandb]'") from exc
        mode = config.logging.wandb_mode
        if mode is not None and mode not in MODES:
            raise ConfigError(f"logging.wandb_mode = {mode!r} is not one of {', '.join(MODES)}")
        directory = Path(config.logging.dir)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(project=config.logging.wandb_project, id=run_id, resume="allow", dir=str(directory),
                               config=config.to_dict(), mode=mode)

    def on_step(self, step: int, metrics: dict) -> None:
        self._run.log({f"train/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def on_eval(self, step: int, metrics: dict) -> None:
        self._run.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        import wandb  # noqa: PLC0415

        self._run.finish()
        wandb.teardown()  # returns once wandb's service has written everything (offline: the run file)
