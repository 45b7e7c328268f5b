"""`logging.tensorboard = true` writes every logged step's metrics as TensorBoard scalars,
beside metrics.jsonl, with the same values."""

import json

import pytest

from mtl.core.config_io import load_config
from mtl.train.loop import train
from mtl.train.testing import TINY

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

BASE = [o for o in TINY if not o.startswith(("train.iters", "logging.callbacks"))]


def test_scalars_match_the_jsonl_metrics(tmp_path):
    result = train(load_config(None, [*BASE, "train.iters=3", "logging.tensorboard=true", f"logging.dir='{tmp_path}'",
                                      "train.eval_interval=3", "train.eval_iters=1"]), progress=False)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses.keys() == result.losses.keys() == {1, 2, 3}
    for step, loss in result.losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6)  # stored as float32
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    grad_norms = {e.step: e.value for e in events.Scalars("train/grad_norm")}
    assert grad_norms == pytest.approx({r["step"]: r["grad_norm"] for r in rows if "grad_norm" in r}, rel=1e-6)
    (val,) = events.Scalars("eval/val_loss")
    assert val.step == 3 and val.value == pytest.approx(result.eval_losses[3], rel=1e-6)
