"""``train.gc_interval``: during ``train()`` Python's automatic collector is off and what existed
before the loop is frozen, a reference cycle dropped in one step is collected at the next
multiple of the interval (not before), and the collector is back on (and nothing frozen) after
the run; ``gc_interval = 0`` leaves it automatic."""

import gc
import weakref

import pytest

from mtl.core.config_io import load_config
from mtl.train.garbage_collection import ManualGC
from mtl.train.loop import train
from mtl.train.testing import TINY, StepWatcher


class Cycle:
    def __init__(self):
        self.me = self  # only the cycle collector frees it


def run_with_watch(gc_interval: int) -> dict[int, tuple[bool, bool]]:
    """At each logged step: whether the collector is on, and whether the cycle dropped at step 1
    is still alive."""
    seen: dict[int, tuple[bool, bool]] = {}
    cycle = []

    def on_step(step, metrics):
        if step == 1:
            cycle.append(weakref.ref(Cycle()))  # garbage at once, but in a cycle
        seen[step] = (gc.isenabled(), cycle[0]() is not None)

    overrides = [o for o in TINY if not o.startswith("train.iters")]
    with StepWatcher("gc_watch", on_step):
        train(load_config(None, [*overrides, "train.iters=4", f"train.gc_interval={gc_interval}",
                                 "logging.callbacks=['gc_watch']"]), progress=False)
    return seen


def test_the_collector_runs_at_the_interval_and_is_restored():
    before = (gc.isenabled(), gc.get_freeze_count())
    seen = run_with_watch(gc_interval=3)
    # off all run long; the cycle of step 1 lives through step 2 and goes in step 3's collection
    assert seen == {1: (False, True), 2: (False, True), 3: (False, False), 4: (False, False)}
    assert (gc.isenabled(), gc.get_freeze_count()) == before  # on again, setup's objects unfrozen


def test_zero_leaves_python_collecting_by_itself():
    seen = run_with_watch(gc_interval=0)
    assert set(seen) == {1, 2, 3, 4}
    assert all(enabled for enabled, _ in seen.values())


def test_objects_from_before_the_loop_are_frozen_during_it():
    old = Cycle()
    old_ref = weakref.ref(old)
    with ManualGC(2) as collector:
        del old  # garbage now, but it existed before the loop: frozen
        young = weakref.ref(Cycle())
        collector.maybe_collect(2)
        assert old_ref() is not None and young() is None  # what the steps create is collected
    gc.collect()
    assert old_ref() is None  # unfrozen after the loop


def test_someone_elses_freeze_and_a_collector_already_off_are_left_alone():
    """The frozen count may only fall (a frozen object whose last referrer goes in a collection
    is freed): a freeze of ours on top would raise it by at least the objects made inside, an
    unfreeze would drop it to zero."""
    gc.disable()
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        with ManualGC(5) as collector:
            made_inside = [Cycle() for _ in range(10)]  # noqa: F841 - objects a freeze of ours would take
            assert gc.get_freeze_count() <= frozen  # nothing frozen on top
            collector.maybe_collect(5)
        assert not gc.isenabled() and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_negative_interval_is_refused_before_any_work():
    with pytest.raises(Exception, match="train.gc_interval = -1 must not be negative"):
        load_config(None, [*TINY, "train.gc_interval=-1"]).resolve(1, 257)
