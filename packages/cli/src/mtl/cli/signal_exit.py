"""The exit status of a run a signal stopped: 128 + the signal's number, as shells report a
process a signal ended (130 for Ctrl-C, 143 for SIGTERM), so a script or scheduler can tell
a stopped run from a finished one. The training loop has saved its checkpoint by then.

The loop's result says that a signal stopped it, not which one; its handlers replace any
other, so :class:`StopSignals` learns the signal from Python's wakeup file descriptor, into
which the interpreter writes the number of every signal it catches, whoever handles it."""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager recording the stop signals this process receives (main thread only;
    elsewhere it records nothing)."""

    def __init__(self):
        self._fds: tuple[int, int] | None = None
        self._previous = -1
        self._received: list[int] = []

    def __enter__(self) -> "StopSignals":
        read_fd, write_fd = os.pipe()
        for fd in (read_fd, write_fd):
            os.set_blocking(fd, False)
        try:
            self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: signals are not delivered here anyway
            os.close(read_fd)
            os.close(write_fd)
            return self
        self._fds = (read_fd, write_fd)
        return self

    def _drain(self) -> None:
        if self._fds is None:
            return
        try:
            while chunk := os.read(self._fds[0], 512):
                self._received += [number for number in chunk if number in STOP_SIGNALS]
        except BlockingIOError:  # nothing more to read
            pass

    def first(self) -> signal.Signals | None:
        """The first stop signal received so far, if any."""
        self._drain()
        return signal.Signals(self._received[0]) if self._received else None

    def __exit__(self, *exc) -> None:
        self._drain()
        if self._fds is not None:
            signal.set_wakeup_fd(self._previous)
            for fd in self._fds:
                os.close(fd)
            self._fds = None


def stopped_exit_code(received: signal.Signals | None) -> int:
    """128 + the signal's number. A rank that stopped because another rank was signalled
    (the ranks agree to stop together) exits as if sent SIGTERM, the signal torchrun stops
    its workers with."""
    return 128 + int(received if received is not None else signal.SIGTERM)
