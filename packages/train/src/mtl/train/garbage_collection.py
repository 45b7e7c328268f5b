"""Python's garbage collector run by the trainer at fixed steps (as Megatron's ``--manual-gc``
and torchtitan's ``gc_freq`` do): ``train.gc_interval``.

Left automatic, CPython starts a collection whenever its allocation counters say so, at a
random point of a step, different on every rank; at dp > 1 one rank's pause holds up the others
at the next collective. Here the automatic collector is off for the run, and every
``gc_interval`` steps each rank runs a full collection at the same iteration, right after
queueing that step, so a short collection overlaps the device's work on it. Full, not only the
young generations (torchtitan's choice), because an object that was alive at one collection and
joins a reference cycle later would otherwise wait in the oldest generation until the run ends,
with whatever CUDA memory it holds.

What exists when the loop starts (modules, the model, the optimizer: a few hundred thousand
objects in a tiny CPU run, whose full collection took 110-145 ms on the CPU machine) is frozen
(``gc.freeze``) until the loop ends, so the collections scan only what the steps created. Two
consequences: such an object that becomes cyclic garbage during the loop is freed only after
it; and what the first steps create (the compiled regions under ``train.compile``) is scanned
by the first collection, which took ~30 ms once on the H100 reference model (later ones no
measurable time, benchmarks/log)."""

from __future__ import annotations

import gc


class ManualGC:
    """``with ManualGC(interval):`` the automatic collector off (``interval > 0``) and
    ``maybe_collect(iteration)`` collecting at multiples of ``interval``; the collector's state
    is restored on exit. ``interval = 0`` leaves Python's automatic collection as it is. A
    freeze someone else made before is left alone (nothing is frozen on top of it)."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = True
        self._froze = False

    def __enter__(self) -> "ManualGC":
        if self.interval > 0:
            self._was_enabled = gc.isenabled()
            gc.collect()  # what setup left behind, once, before the steps
            self._froze = gc.get_freeze_count() == 0
            if self._froze:
                gc.freeze()
            gc.disable()
        return self

    def maybe_collect(self, iteration: int) -> None:
        if self.interval > 0 and iteration % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.interval <= 0:
            return
        if self._froze:
            gc.unfreeze()  # setup's objects collectable again
        if self._was_enabled:
            gc.enable()
