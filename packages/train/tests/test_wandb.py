"""``logging.wandb = true`` logs every step's metrics through the real wandb package (offline
here), and a resumed run continues the same W&B run (the id kept in logging.dir)."""

import json

import pytest

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.train.loop import train
from mtl.train.testing import TINY

wandb = pytest.importorskip("wandb", reason="needs the wandb package: pip install 'mtl-train[wandb]'")

BASE = [o for o in TINY if not o.startswith("train.iters")]


def test_metrics_reach_an_offline_wandb_run_and_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    common = [*BASE, "logging.wandb=true", "logging.wandb_mode='offline'", f"logging.dir='{logs}'",
              f"ckpt.save='{ckpt}'"]
    first = train(load_config(None, [*common, "train.iters=2"]), progress=False)
    run_id = (logs / "wandb_run_id").read_text().strip()
    second = train(load_config(None, [*common, "train.iters=3"]), progress=False)
    assert (logs / "wandb_run_id").read_text().strip() == run_id
    runs = sorted((logs / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, runs  # one local directory per process, one W&B run id
    logged = b"".join(path.read_bytes() for run in runs for path in run.glob("run-*.wandb"))
    losses = {**first.losses, **second.losses}
    assert sorted(losses) == [1, 2, 3]
    for step, loss in losses.items():  # the history records hold each value as JSON text
        assert json.dumps(loss).encode() in logged, (step, loss)
    assert b"train/loss" in logged and b"train/tokens_per_s" in logged


def test_an_unknown_mode_is_named(tmp_path):
    with pytest.raises(ConfigError, match="logging.wandb_mode = 'sometimes' is not one of online, offline, disabled"):
        train(load_config(None, [*BASE, "train.iters=1", "logging.wandb=true", "logging.wandb_mode='sometimes'",
                                 f"logging.dir='{tmp_path}'"]), progress=False)
