"""The engine on a thread of its own, fed by the server's event loop.

Requests are checked on the event loop (``Engine.check`` reads only constants) so a bad one is
answered at once; the engine thread takes additions and aborts from a queue before each step,
steps while there is work, and hands each output to the asyncio queue of its HTTP request. An
abort (a client gone) is taken before the next step, which frees the request's blocks."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mtl.core.errors import MtlError
from mtl.core.log import get_logger
from mtl.serve.engine import Engine, QueueFull, StepOutput
from mtl.serve.metrics import ServeMetrics
from mtl.serve.sampling import SamplingParams

log = get_logger(__name__)
_IDLE_WAIT_S = 0.25  # how often an idle engine thread refreshes the metrics


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrived: float
    first_token: bool = False


class EngineStopped(MtlError):
    """The engine thread is not running (it failed, or the server is shutting down): HTTP 503."""


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServeMetrics, warm_up: Callable[[], None] | None = None):
        """``warm_up`` runs first on the engine thread: CUDA graphs belong to the thread that
        records them, so the compiled decode step is recorded where it will be replayed."""
        self.engine = engine
        self.metrics = metrics
        self._warm_up = warm_up
        self.ready = threading.Event()  # set once the warm-up is done: /health answers 503 before
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._sinks: dict[int, _Sink] = {}
        self._pending_adds = 0  # submitted, not yet taken by the engine thread
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtl-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt_ids: list[int], params: SamplingParams, outputs: asyncio.Queue) -> int:
        """Queue a request whose outputs go to ``outputs``; its id. RequestError for a bad
        request, QueueFull when the waiting queue is full."""
        if not self._thread.is_alive():
            raise EngineStopped("the engine is not running (see the server's log); no request is taken")
        self.engine.check(prompt_ids, params)
        with self._lock:
            if self._pending_adds + len(self.engine.scheduler.waiting) >= self.engine.config.max_waiting:
                raise QueueFull(f"the server's queue is full ({self.engine.config.max_waiting} requests waiting); "
                                "retry later")
            self._pending_adds += 1
        request_id = next(self._ids)
        self._commands.put(("add", request_id, prompt_ids, params,
                            _Sink(asyncio.get_running_loop(), outputs, time.monotonic())))
        return request_id

    def abort(self, request_id: int) -> None:
        self._commands.put(("abort", request_id))

    def stop(self) -> None:
        """Abort what is left, stop the thread (and the other TP ranks)."""
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command[0] == "add":
                _, request_id, prompt_ids, params, sink = command
                with self._lock:
                    self._pending_adds -= 1
                self._sinks[request_id] = sink
                try:
                    self.engine.add(prompt_ids, params, request_id=request_id)
                    self.metrics.prompt_tokens.inc(len(prompt_ids))
                except MtlError:  # checked on submit; a refusal here ends the request without tokens
                    self._deliver(StepOutput(request_id, [], "", [], "abort"))
            elif command[0] == "abort":
                self.engine.abort(command[1])
                self._sinks.pop(command[1], None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if not sink.first_token and out.new_ids:
            sink.first_token = True
            self.metrics.time_to_first_token.observe(time.monotonic() - sink.arrived)
        if out.finish_reason is not None:
            del self._sinks[out.request_id]
        sink.loop.call_soon_threadsafe(sink.outputs.put_nowait, out)

    def _run(self) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up()
            self.ready.set()
            while not self._stopping.is_set():
                self._take_commands(block=not self.engine.has_work)
                outputs = self.engine.step() if self.engine.has_work else []
                for out in outputs:
                    self._deliver(out)
                self.metrics.engine_state(self.engine.stats(), sum(len(o.new_ids) for o in outputs))
        except Exception:  # the engine is broken: say so, and end every open request
            log.exception("the engine stopped on an error")
        finally:
            self._abort_all()
            self.engine.runner.stop_followers()

    def _abort_all(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink.loop.call_soon_threadsafe(sink.outputs.put_nowait, StepOutput(request_id, [], "", [], "abort"))
        self._sinks.clear()
        self.metrics.engine_state(self.engine.stats(), 0)
