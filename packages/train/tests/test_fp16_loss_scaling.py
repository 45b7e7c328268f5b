"""fp16 with dynamic loss scaling inside the training loop: steps whose gradients overflow
are skipped and counted, the scale halves on each, and training goes on once it fits.

The tiny model's fp16 gradients overflow at a loss scale of 2**24 and fit at 2**20 (CPU
autocast, measured), so starting at 2**24 gives a few skipped steps, then applied ones."""

import json

from mtl.core.config_io import load_config
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")]
START = 2.0**24


def test_overflowing_steps_are_skipped_counted_and_the_scale_halves(tmp_path):
    result = train(load_config(None, [
        *BASE, "train.iters=8", "train.precision='fp16'", f"train.initial_loss_scale={START!r}",
        f"logging.dir='{tmp_path}'", "logging.callbacks=['jsonl']",
    ]), progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    skipped = [r["skipped_steps"] for r in rows]
    assert 1 <= result.skipped_steps < 8 and skipped[-1] == result.skipped_steps
    assert skipped == sorted(skipped) and skipped[0] == 1  # the first step overflows
    for row in rows:  # one halving per skipped step, no growth within the 1000-step window
        assert row["loss_scale"] == START / 2 ** row["skipped_steps"]
    applied = [r for r in rows if r["skipped_steps"] == result.skipped_steps][1:]
    assert applied and all(r["grad_norm"] < 1e3 for r in applied)  # unscaled, finite norms again
