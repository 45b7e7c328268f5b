import math

import pytest

from mtl.core.config import TrainConfig
from mtl.train.lr_schedule import learning_rate


def cfg(**kw):
    t = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=4, iters=20, **kw)
    t.lr_decay_iters = t.iters
    return t


def test_warmup_is_linear_to_peak():
    t = cfg(lr_schedule="cosine")
    assert [learning_rate(t, i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "wsd"])
def test_schedules_end_points(schedule):
    t = cfg(lr_schedule=schedule)
    last = learning_rate(t, t.iters - 1)
    assert last == pytest.approx(1.0 if schedule == "constant" else 0.1)


def test_cosine_midpoint_and_monotone():
    t = cfg(lr_schedule="cosine")
    mid = learning_rate(t, 4 + 8 - 1)  # halfway through the 16 decay steps
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    values = [learning_rate(t, i) for i in range(4, 20)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_holds_then_anneals():
    t = cfg(lr_schedule="wsd", wsd_decay_fraction=0.25)
    stable = [learning_rate(t, i) for i in range(4, 16)]
    assert stable == [1.0] * 12
    assert learning_rate(t, 17) < 1.0
