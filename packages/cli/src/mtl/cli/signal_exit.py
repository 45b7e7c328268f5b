"""The exit status of a run a signal stopped: 128 + the signal's number, as shells report a
process a signal ended (130 for Ctrl-C, 143 for SIGTERM), so a script or scheduler can tell
a stopped run from a finished one. The training loop has saved its checkpoint by then."""

from __future__ import annotations

import signal


def stopped_exit_code(received: str | None) -> int:
    """128 + the number of ``received`` (a name such as ``"SIGINT"``, ``TrainResult.stop_signal``).
    A rank that stopped because another rank was signalled (the ranks agree to stop together)
    exits as if sent SIGTERM, the signal torchrun stops its workers with."""
    return 128 + int(signal.Signals[received] if received is not None else signal.SIGTERM)
