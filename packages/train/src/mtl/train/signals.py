"""Stop requests: SIGTERM (a scheduler's preemption notice, or torchrun shutting its workers
down) and SIGINT (Ctrl-C) both ask the run to stop after the current step, save a checkpoint
and exit (``mtl train`` exits 128 + the signal's number: 130, 143). A second SIGINT aborts at once (KeyboardInterrupt: nothing more is saved, and a
save it interrupts is never committed, so ``latest`` still names a complete checkpoint)."""

from __future__ import annotations

import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager installing the handlers (main thread only; elsewhere it only holds a
    flag that stays False). ``received`` names the first signal, e.g. ``"SIGINT"``."""

    def __init__(self, announce: bool = True):
        self.received: str | None = None
        self.announce = announce
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for signum in STOP_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: no handlers, no flag
                self._previous.clear()
                break
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT:
            # the second Ctrl-C: give the default behaviour back and abort now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if self.received is None:
            self.received = name
            if self.announce:
                again = " (Ctrl-C again aborts without saving)" if signum == signal.SIGINT else ""
                print(f"\n{name}: stopping after this step and saving a checkpoint{again}", file=sys.stderr,
                      flush=True)

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
