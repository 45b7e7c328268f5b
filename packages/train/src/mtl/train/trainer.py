"""The training loop as a ``Trainer``: set up once (model, optimizer, data, the checkpoint it
resumes from), then step, evaluate and checkpoint until ``train.iters``, ``train.exit_interval``
or a stop signal, and tear down once. ``Trainer.train`` is the whole loop on one screen."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from mtl.ckpt import latest_iteration, prune_checkpoints
from mtl.ckpt.directory import committed_iterations, iteration_dir
from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.log import ONE_RANK, get_logger
from mtl.core.plugins import registry
from mtl.models.moe import moe_step_metrics
from mtl.train.agreement import Agreement, agree
from mtl.train.batches import MicroBatches
from mtl.train.checkpointing import checkpoint_format, load_checkpoint, save_checkpoint
from mtl.train.garbage_collection import ManualGC
from mtl.train.health import LossWatch, NonFiniteError, out_of_memory_error
from mtl.train.layout_change import layout_change_note
from mtl.train.lr_schedule import learning_rate
from mtl.train.metrics import throughput
from mtl.train.precision import LossScaler
from mtl.train.progress import ProgressDisplay
from mtl.train.resume import check_compatible, has_checkpoint, read_start, roll_back_latest, start_metadata
from mtl.train.setup import Run, setup
from mtl.train.signals import StopRequest
from mtl.train.step import StepResult, eval_step, queue_train_step
from mtl.train.validate import check_training_settings

log = get_logger(__name__)


@dataclass
class TrainResult:
    config: RunConfig
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (last stage only)
    eval_losses: dict[int, float] = field(default_factory=dict)
    final_iteration: int = 0
    stopped_by: str = "iters"  # iters | exit_interval | signal
    # the signal this process received, e.g. "SIGINT" (None where only another rank was signalled)
    stop_signal: str | None = None
    skipped_steps: int = 0  # fp16 overflow steps the loss scaler skipped
    bad_steps: int = 0  # NaN/Inf steps skipped under train.skip_bad_steps
    run: Run | None = None  # the model and optimizer as they ended, for inspection and tests


def _chunk_iterators(micro_batches: list, num_chunks: int):
    return [iter(micro_batches) for _ in range(num_chunks)]


class Trainer:
    """One run of ``config``: ``train()`` calls ``setup`` once, ``step`` per iteration (with
    ``evaluate`` and ``checkpoint`` when due) and ``teardown`` once, also after an exception."""

    def __init__(self, config: RunConfig, progress: bool = True):
        self.config = config
        self.progress = progress

    def train(self) -> TrainResult:
        self.setup()
        t, completed = self.config.train, False
        try:
            with StopRequest(announce=self.rank0) as stop, ManualGC(t.gc_interval) as collector:
                while self.iteration < t.iters:
                    agreed = self.step(stop, collector)
                    if t.eval_interval and self.iteration % t.eval_interval == 0:
                        self.result.eval_losses[self.iteration] = self.evaluate()
                    if (self.config.ckpt.interval and self.iteration % self.config.ckpt.interval == 0
                            or agreed.time_due):
                        self.checkpoint()
                    if agreed.stop or (t.exit_interval and self.iteration % t.exit_interval == 0):
                        self.result.stopped_by = "signal" if agreed.stop else "exit_interval"
                        self.result.stop_signal = stop.received
                        break
                # still under the handlers: a second Ctrl-C during this save aborts it (never committed)
                if self.config.ckpt.save_on_exit and self.last_saved != self.iteration:
                    self.checkpoint()
                self.finish_async_save()
            completed = True
        finally:
            # after an exception (or a second Ctrl-C) nothing is saved; a save in flight is
            # never committed, so ckpt.save's 'latest' still names the last complete checkpoint
            self.teardown(completed)
        return self.result

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Check the settings, build the run, restore its checkpoint, open the metric sinks."""
        if self.config.ckpt.async_save and self.config.ckpt.format != "zarr":
            raise ConfigError(f"ckpt.async_save = true is available for ckpt.format = 'zarr' only, "
                              f"not '{self.config.ckpt.format}'; set ckpt.async_save = false")
        check_training_settings(self.config)
        if self.config.ckpt.save or self.config.ckpt.load:
            checkpoint_format(self.config)  # an unknown format fails here, before any work
        self.run = run = setup(self.config)
        self.config = cfg = run.config  # resolved
        self.rank0 = run.topology.rank == 0
        self.scaler = LossScaler.for_config(cfg.train)
        self.iteration, self.consumed = self.restore()
        self.writer = self._writes_metrics()
        self.callbacks = self._build_callbacks() if self.writer else []
        self.train_batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, self.consumed)
        self.result = TrainResult(cfg)
        self.display = ProgressDisplay(cfg, self.iteration, enabled=self.progress and self.writer,
                                       on_gpu=run.device.type == "cuda")
        self.saver = None
        if cfg.ckpt.async_save and cfg.ckpt.save:
            from mtl.ckpt import AsyncSaver

            self.saver = AsyncSaver()
        self.watch = LossWatch(run.chunks, run.topology.is_last_stage, run.device)
        self.last_saved, self.last_save_time = self.iteration, time.monotonic()
        self.micro = self.train_batches.take(cfg.train.num_micro_batches) if self.iteration < cfg.train.iters else []
        self.data_error: Exception | None = None  # the next step's batches failed: raised when it starts

    def restore(self) -> tuple[int, int]:
        """Load the checkpoint ``setup`` chose (``resume.starting_checkpoint``); the iteration
        and consumed samples to go on from (0, 0 for fresh weights or a weights-only start)."""
        run, cfg, start = self.run, self.config, self.run.start
        if start.directory is None:
            return 0, 0
        metadata = start_metadata(start)
        finetune = start.key == "ckpt.finetune_from"
        check_compatible(metadata["config"], cfg, start.directory, start.iteration, finetune=finetune)
        note = layout_change_note(metadata, cfg, run.topology, run.device.type, start.full_resume)
        if note and self.rank0:
            log.info("%s", note)
        metadata = read_start(start, load_checkpoint, cfg, run.topology, run.chunks, run.optimizer,
                                         start.directory, load_optimizer=start.full_resume,
                                         iteration=start.iteration, fresh_heads=finetune)
        roll_back_latest(cfg, start)
        iteration, consumed = 0, 0
        if start.full_resume and not metadata.get("model_only"):
            iteration, consumed = metadata["iteration"], metadata["consumed_samples"]
            if self.scaler.dynamic and "loss_scaler" in metadata:
                self.scaler.load_state_dict(metadata["loss_scaler"])
            if self.rank0:
                why = (" (ckpt.save holds this run's checkpoints; --fresh starts over in an empty directory)"
                       if start.key == "ckpt.save" else "")
                log.info("resuming at iteration %d from %s%s", iteration, start.path, why)
        elif self.rank0:
            log.info("weights from %s (its iteration %d); optimizer, schedule and data start at iteration 0",
                     start.directory, metadata["iteration"])
        if iteration >= cfg.train.iters and self.rank0:
            log.info("iteration %d already reaches train.iters = %d: nothing to train (raise train.iters to go on)",
                     iteration, cfg.train.iters)
        return iteration, consumed

    def _writes_metrics(self) -> bool:
        """Only the last pipeline stage's first rank logs (it has the loss)."""
        t = self.run.topology
        return t.is_last_stage and t.tp_rank == 0 and t.dp_rank == 0 and t.cp_rank == 0

    def _build_callbacks(self) -> list:
        cfg = self.config
        names = (list(cfg.logging.callbacks) + (["tensorboard"] if cfg.logging.tensorboard else [])
                 + (["wandb"] if cfg.logging.wandb else []))
        return [registry("train callback").get(name).build(cfg) for name in dict.fromkeys(names)]

    # -- step ----------------------------------------------------------------------------

    def step(self, stop: StopRequest, collector: ManualGC) -> Agreement:
        """One iteration: queue it, read the next step's batches while the device works on it,
        wait, then agree with every rank on what follows, and log."""
        if self.data_error is not None:
            raise self.data_error
        run, t = self.run, self.config.train
        began = time.perf_counter()
        lr = learning_rate(t, self.iteration)
        self.watch.reset()
        try:
            pending = queue_train_step(self.config, run.topology, run.chunks, run.optimizer,
                                       _chunk_iterators(self.micro, len(run.chunks)), self.scaler, lr, run.device)
            self._read_next_batches()  # their copies queue behind this step's work
            collector.maybe_collect(self.iteration + 1)  # while the device works on this step
            step = pending.result()
        except torch.cuda.OutOfMemoryError as exc:
            raise out_of_memory_error(self.config, exc, self.iteration + 1, run.topology.rank) from exc
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
        self.iteration += 1
        self.consumed += t.global_batch_size
        self.result.losses[self.iteration] = step.loss
        agreed = self._agree(step, stop)
        if agreed.bad:
            self._bad_step(agreed, step)
        self._log_step(step, lr, elapsed)
        return agreed

    def _read_next_batches(self) -> None:
        """The next step's micro-batches. A read error belongs to the next step: this one still
        logs and saves, and the error is raised when the next one starts."""
        t = self.config.train
        try:
            self.micro = self.train_batches.take(t.num_micro_batches) if self.iteration + 1 < t.iters else []
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged before the next step
            self.data_error = exc

    def _agree(self, step: StepResult, stop: StopRequest) -> Agreement:
        overflow = self.scaler.dynamic and step.skipped  # fp16: the loss scaler's business
        minutes = self.config.ckpt.interval_minutes
        last_stage = self.run.topology.is_last_stage
        return agree(self.run.topology, self.run.device, stop=stop.received is not None,
                     origin=not overflow and self.watch.fired(),
                     loss_bad=not overflow and last_stage and not math.isfinite(step.loss),
                     grad_bad=not overflow and not math.isfinite(step.grad_norm),
                     time_due=minutes > 0 and time.monotonic() - self.last_save_time >= 60 * minutes)

    def _bad_step(self, agreed: Agreement, step: StepResult) -> None:
        """Skip a NaN/Inf step within ``train.skip_bad_steps``; beyond it, stop without saving."""
        t = self.config.train
        self.result.bad_steps += 1
        message = agreed.bad_step_message(step.grad_norm, self.iteration)
        if self.result.bad_steps > t.skip_bad_steps:
            allowed = (f"more than train.skip_bad_steps = {t.skip_bad_steps}" if t.skip_bad_steps
                       else "set train.skip_bad_steps = N to skip up to N such steps")
            raise NonFiniteError(f"{message}; the run stopped without saving ({allowed}). Last good checkpoint: "
                                 f"{self._last_good_checkpoint()}")
        if self.rank0:
            log.warning("%s: step skipped (%d of at most train.skip_bad_steps = %d)", message,
                        self.result.bad_steps, t.skip_bad_steps)

    def _last_good_checkpoint(self) -> str:
        save = self.config.ckpt.save
        if has_checkpoint(save) and latest_iteration(save) in committed_iterations(save):
            return iteration_dir(save, latest_iteration(save))
        if self.run.start.directory is not None:
            return self.run.start.path
        return "none (no checkpoint was saved yet)"

    def _log_step(self, step: StepResult, lr: float, elapsed: float) -> None:
        cfg, iteration = self.config, self.iteration
        logged = iteration % cfg.logging.interval == 0 or iteration == cfg.train.iters
        # routers' aux/z losses and dropped tokens since the last logged step (a collective,
        # so every rank asks, only when logging); {} without experts
        experts = moe_step_metrics(self.run.chunks, self.run.topology) if logged else {}
        if not self.writer:
            return
        metrics = {"loss": step.loss, "lr": lr, "grad_norm": step.grad_norm,
                   "skipped_steps": self.scaler.skipped_steps, "bad_steps": self.result.bad_steps,
                   "loss_scale": self.scaler.scale, **step.metrics, **throughput(cfg, elapsed), **experts}
        if logged:
            for cb in self.callbacks:
                cb.on_step(iteration, metrics)
        self.display.step(iteration, metrics, logged)

    def _say(self, text: str) -> None:
        if self.display.mode != "none":
            self.display.message(text)
        elif self.writer:  # the writer is the last pipeline stage, not always rank 0
            log.info("%s", text, extra=ONE_RANK)

    # -- evaluate ------------------------------------------------------------------------

    def evaluate(self) -> float:
        """The mean loss over ``train.eval_iters`` batches of the validation split."""
        return evaluate(self.run, self.iteration, self.callbacks, self._say if self.writer else None)

    # -- checkpoint ----------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Save this iteration into ``ckpt.save`` (in the background under ``ckpt.async_save``,
        after the previous background save has committed)."""
        cfg, run, step = self.config, self.run, self.iteration
        if cfg.ckpt.save:
            self.finish_async_save()
            save_checkpoint(cfg, run.topology, run.chunks, run.optimizer, iteration=step,
                            consumed_samples=self.consumed, scaler_state=self.scaler.state_dict(),
                            saver=self.saver)
            if self.saver is None:
                self._committed(step)
            else:
                self._say(f"saving checkpoint {iteration_dir(cfg.ckpt.save, step)} in the background")
        self.last_saved, self.last_save_time = step, time.monotonic()

    def finish_async_save(self) -> None:
        if self.saver is None:
            return
        in_flight = self.saver.in_flight
        if self.saver.wait() is not None:
            self._committed(in_flight)

    def _committed(self, step: int) -> None:
        self._say(f"saved checkpoint {iteration_dir(self.config.ckpt.save, step)}")
        if self.config.ckpt.keep_last and self.rank0:  # the save has just committed
            prune_checkpoints(self.config.ckpt.save, self.config.ckpt.keep_last)

    # -- teardown ------------------------------------------------------------------------

    def teardown(self, completed: bool) -> None:
        """Close the display and the metric sinks; after a completed run hand back complete
        parameters (``parallel.overlap_param_gather``) and fill in the result."""
        self.display.close()
        self.watch.remove()
        if completed:
            for chunk in self.run.chunks:
                chunk.finish_param_sync()
        for cb in self.callbacks:
            cb.close()
        if completed:
            self.result.final_iteration = self.iteration
            self.result.skipped_steps = self.scaler.skipped_steps
            self.result.config = self.config
            self.result.run = self.run


def evaluate(run: Run, iteration: int, callbacks: list, show=None) -> float:
    cfg = run.config
    valid = MicroBatches(run.datasets["valid"], cfg, run.topology, run.device, consumed_samples=0)
    batches = []
    for _ in range(cfg.train.eval_iters):
        micro = valid.take(cfg.train.num_micro_batches)
        batches.append(eval_step(cfg, run.topology, run.chunks, _chunk_iterators(micro, len(run.chunks)), run.device))
    means = {name: sum(b.get(name, math.nan) for b in batches) / len(batches) for name in batches[0]}
    loss = means.pop("loss")
    # the family's other metrics too (val_accuracy of a classifier, val_mlm_accuracy of bert)
    metrics = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), **{f"val_{k}": v for k, v in means.items()}}
    for cb in callbacks:
        cb.on_eval(iteration, metrics)
    if show is not None:
        extra = "".join(f" | {name} {value:.4f}" for name, value in means.items())
        show(f"eval at step {iteration}: loss {loss:.4f} | ppl {metrics['val_ppl']:.2f}{extra}")
    return loss
