"""``AsyncSaver``: the same save with the file writes in a background thread.

``save`` runs the collective first phase and the device->host copy on the caller's thread
(so the training step may modify parameters right after it returns), then writes the
shards in a thread. ``wait`` joins the thread and runs the collective commit; the next
``save`` calls ``wait`` first. Only file I/O runs in the thread: collectives stay on the
caller's thread, in the same order on every rank, so they never interleave with training's.

    saver = AsyncSaver()
    saver.save(state, "ckpts", iteration=100, metadata={"step": 100})
    ...  # training continues
    saver.wait()  # iter_0000100 is committed and 'latest' names it
"""

from __future__ import annotations

import threading
from typing import Any

from mtl.ckpt import directory
from mtl.ckpt.save import SavePlan, finalize_save, prepare_save, write_shards


class AsyncSaver:
    """One checkpoint in flight at a time; collective like ``save`` (same group on all ranks)."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._plan: SavePlan | None = None
        self._thread: threading.Thread | None = None
        self._written: list[dict[str, Any]] | None = None
        self._error: str | None = None

    @property
    def in_flight(self) -> int | None:
        """The iteration being saved, or None."""
        return self._plan.iteration if self._plan is not None else None

    def _write(self, plan: SavePlan) -> None:
        try:
            self._written = write_shards(plan)
        except Exception as exc:  # reported to every rank by wait()
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            plan.host_arrays = []  # release the host copy as soon as it is on disk

    def save(self, state: Any, ckpt_dir: str, iteration: int, metadata: dict[str, Any] | None = None) -> None:
        """Start saving; returns once the shards are copied to host memory."""
        self.wait()
        plan = prepare_save(state, ckpt_dir, iteration, metadata if metadata is not None else {}, self.process_group)
        self._written, self._error = None, None
        try:
            plan.snapshot(copy=True)
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
        self._plan = plan
        if self._error is None:
            self._thread = threading.Thread(target=self._write, args=(plan,), name=f"mtl-ckpt-save-{iteration}", daemon=True)
            self._thread.start()

    def wait(self) -> str | None:
        """Finish the save in flight (collective): join the writer, then commit on rank 0 once
        every rank has written. Returns the committed directory, or None if nothing was in flight."""
        if self._plan is None:
            return None
        plan, self._plan = self._plan, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        finalize_save(plan, self._written, self._error)
        return directory.iteration_dir(plan.ckpt_dir, plan.iteration)

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.wait()
