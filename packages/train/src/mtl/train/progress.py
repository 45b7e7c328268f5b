"""Where a run is: a live display on an interactive terminal (rich: step, loss, tokens/s,
elapsed, ETA), plain lines every ``logging.interval`` steps otherwise (a log file, a pipe, a
scheduler's output), nothing with ``logging.progress = "none"``. Messages (saves, evaluation)
print above the live display. TFLOP/s per GPU and MFU are shown on GPUs only."""

from __future__ import annotations

import sys
import time

from mtl.core.config import RunConfig
from mtl.train.metrics import progress_line


def choose_mode(setting: str, stream=None) -> str:
    """``auto`` -> ``bar`` when the stream is a terminal (and rich is installed), else ``lines``."""
    stream = stream or sys.stdout
    if setting != "auto":
        return setting
    try:
        import rich  # noqa: F401, PLC0415
    except ImportError:
        return "lines"
    return "bar" if hasattr(stream, "isatty") and stream.isatty() else "lines"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """Shown by one rank (the one with the loss); ``enabled=False`` makes every call a no-op."""

    def __init__(self, config: RunConfig, start_iteration: int, enabled: bool, on_gpu: bool):
        self.config = config
        self.total = config.train.iters
        self.start_iteration = start_iteration
        self.on_gpu = on_gpu
        self.mode = choose_mode(config.logging.progress) if enabled else "none"
        self.started = time.monotonic()
        self._step_times: list[float] = []
        self._progress = None
        self._task = None
        if self.mode == "bar":
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
            refresh_per_second=4, transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total, completed=self.start_iteration,
                                             stats="", eta="-")

    def eta_seconds(self, iteration: int) -> float | None:
        """Remaining steps times the mean of the recent step times (the first step, which
        compiles and warms up, left out once there are others)."""
        times = self._step_times[1:] if len(self._step_times) > 1 else self._step_times
        if not times:
            return None
        recent = times[-50:]
        return (self.total - iteration) * sum(recent) / len(recent)

    def step(self, iteration: int, metrics: dict, logged: bool) -> None:
        """Every step; ``logged``: this step is a logging-interval step (plain lines print then)."""
        self._step_times.append(metrics["iter_s"])
        if self.mode == "lines" and logged:
            eta = self.eta_seconds(iteration)
            line = progress_line(iteration, self.total, metrics, on_gpu=self.on_gpu)
            line += f" | elapsed {format_duration(time.monotonic() - self.started)}"
            if eta is not None and iteration < self.total:
                line += f" | ETA {format_duration(eta)}"
            print(line, flush=True)
        elif self.mode == "bar":
            stats = f"loss {metrics['loss']:.4f}  {metrics['tokens_per_s']:,.0f} tok/s"
            if self.on_gpu and "tflops_per_gpu" in metrics:  # a family without a FLOP count has none
                stats += f"  {metrics['tflops_per_gpu']:.0f} TFLOP/s/GPU"
                if "mfu" in metrics:
                    stats += f"  MFU {100 * metrics['mfu']:.1f}%"
            eta = self.eta_seconds(iteration)
            self._progress.update(self._task, completed=iteration, stats=stats,
                                  eta=format_duration(eta) if eta is not None else "-")

    def message(self, text: str) -> None:
        if self.mode == "bar":
            self._progress.console.print(text, highlight=False, markup=False)
        elif self.mode == "lines":
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
