"""Python's garbage collector run by the trainer at fixed steps (Megatron's ``--manual-gc``,
torchtitan's ``gc_freq``): ``train.gc_interval``.

Left automatic, CPython starts a collection whenever its allocation counters say so; a full
(generation 2) pass over a training process's millions of objects stops the host for
milliseconds at a random point of a step. Where the host is only just ahead of the device
(a compiled step launches ~10,000 kernels), that pause shows up as idle GPU time, different
on every rank and every step, and at dp > 1 one rank's pause holds up the others at the next
collective. Here the automatic collector is off for the run, and every ``gc_interval`` steps
each rank collects the young generations (where the short-lived reference cycles of a step
are) at the same iteration, while the step just queued keeps the device busy."""

from __future__ import annotations

import gc


class ManualGC:
    """``with ManualGC(interval):`` the automatic collector off (``interval > 0``) and
    ``maybe_collect(iteration)`` collecting at multiples of ``interval``; the collector's state
    is restored on exit. ``interval = 0`` leaves Python's automatic collection as it is."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = True

    def __enter__(self) -> "ManualGC":
        if self.interval > 0:
            self._was_enabled = gc.isenabled()
            gc.collect()  # what setup left behind, once, before the steps
            gc.disable()
        return self

    def maybe_collect(self, iteration: int) -> None:
        if self.interval > 0 and iteration % self.interval == 0:
            gc.collect(1)  # generations 0 and 1: everything allocated since the last collection

    def __exit__(self, *exc) -> None:
        if self.interval > 0 and self._was_enabled:
            gc.enable()
