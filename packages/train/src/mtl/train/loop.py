"""The training loop: steps, logging and progress, evaluation, checkpoints (every
``ckpt.interval`` steps or ``ckpt.interval_minutes``, at the end, at ``train.exit_interval``, on
SIGTERM/SIGINT), resume by default, and NaN/Inf steps stopped (or skipped) with their origin."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.log import get_logger
from mtl.core.plugins import registry
from mtl.models.moe import moe_step_metrics
from mtl.train.batches import MicroBatches
from mtl.ckpt import latest_iteration, prune_checkpoints
from mtl.ckpt.directory import iteration_dir
from mtl.train.checkpointing import (checkpoint_format, has_checkpoint, load_checkpoint, save_checkpoint,
                                     starting_checkpoint)
from mtl.train.garbage_collection import ManualGC
from mtl.train.health import LossWatch, NonFiniteError, out_of_memory_error
from mtl.train.lr_schedule import learning_rate
from mtl.train.metrics import throughput
from mtl.train.precision import LossScaler
from mtl.train.progress import ProgressDisplay
from mtl.train.setup import Run, setup
from mtl.train.signals import StopRequest
from mtl.train.step import eval_step, queue_train_step
from mtl.train.validate import check_training_settings

log = get_logger(__name__)


@dataclass
class TrainResult:
    config: RunConfig
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (last stage only)
    eval_losses: dict[int, float] = field(default_factory=dict)
    final_iteration: int = 0
    stopped_by: str = "iters"  # iters | exit_interval | signal
    skipped_steps: int = 0  # fp16 overflow steps the loss scaler skipped
    bad_steps: int = 0  # NaN/Inf steps skipped under train.skip_bad_steps
    run: Run | None = None  # the model and optimizer as they ended, for inspection and tests


def _writes_metrics(run: Run) -> bool:
    """Only the last pipeline stage's first rank logs (it has the loss)."""
    t = run.topology
    return t.is_last_stage and t.tp_rank == 0 and t.dp_rank == 0 and t.cp_rank == 0


def _chunk_iterators(micro_batches: list, num_chunks: int):
    return [iter(micro_batches) for _ in range(num_chunks)]


@dataclass
class _Agreed:
    """What every rank decides together after a step (one all-reduce)."""

    stop: bool = False  # some rank got SIGTERM/SIGINT
    origin: int | None = None  # lowest rank whose own loss was NaN/Inf
    loss_bad: bool = False
    grad_bad: bool = False
    time_due: bool = False  # rank 0's clock says ckpt.interval_minutes passed

    @property
    def bad(self) -> bool:
        return self.loss_bad or self.grad_bad


def _agree(run: Run, stop: bool, origin: bool, loss_bad: bool, grad_bad: bool, time_due: bool) -> _Agreed:
    t = run.topology
    values = [float(stop), float(t.world_size - t.rank) if origin else 0.0, float(loss_bad), float(grad_bad),
              float(time_due and t.rank == 0)]
    if dist.is_initialized():
        flags = torch.tensor(values, dtype=torch.float32, device=run.device)  # exact for ranks < 2**24
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
    return _Agreed(stop=values[0] > 0, origin=int(t.world_size - values[1]) if values[1] > 0 else None,
                   loss_bad=values[2] > 0, grad_bad=values[3] > 0, time_due=values[4] > 0)


def _last_good_checkpoint(cfg: RunConfig, start_dir: str | None) -> str:
    for directory in (cfg.ckpt.save, start_dir):
        if has_checkpoint(directory):
            return iteration_dir(directory, latest_iteration(directory))
    return "none (no checkpoint was saved yet)"


def _bad_step_message(agreed: _Agreed, grad_norm: float, iteration: int) -> str:
    """The same words on every rank (a non-last pipeline stage has no loss of its own)."""
    what = (["loss"] if agreed.loss_bad else []) + ([f"gradient norm ({grad_norm})"] if agreed.grad_bad else [])
    where = (f"first seen in rank {agreed.origin}'s loss" if agreed.origin is not None
             else "the gradient norm is global: every rank sees it")
    return f"non-finite {' and '.join(what)} at step {iteration} ({where})"


def train(config: RunConfig, progress: bool = True) -> TrainResult:
    if config.ckpt.async_save and config.ckpt.format != "zarr":
        raise ConfigError(f"ckpt.async_save = true is available for ckpt.format = 'zarr' only, "
                          f"not '{config.ckpt.format}'; set ckpt.async_save = false")
    check_training_settings(config)
    if config.ckpt.save or config.ckpt.load:
        checkpoint_format(config)  # an unknown format fails here, before any work
    run = setup(config)
    cfg, t = run.config, run.config.train
    rank0 = run.topology.rank == 0
    scaler = LossScaler.for_config(t)
    iteration, consumed = 0, 0
    start = starting_checkpoint(cfg)
    if start.directory is not None:
        metadata = load_checkpoint(cfg, run.topology, run.chunks, run.optimizer, start.directory,
                                   load_optimizer=start.full_resume)
        if start.full_resume and not metadata.get("model_only"):
            iteration, consumed = metadata["iteration"], metadata["consumed_samples"]
            if scaler.dynamic and "loss_scaler" in metadata:
                scaler.load_state_dict(metadata["loss_scaler"])
            if rank0:
                why = (" (ckpt.save holds this run's checkpoints; --fresh starts over in an empty directory)"
                       if start.key == "ckpt.save" else "")
                log.info("resuming at iteration %d from %s%s", iteration, iteration_dir(start.directory, iteration), why)
        elif rank0:
            log.info("weights from %s (its iteration %d); optimizer, schedule and data start at iteration 0",
                     start.directory, metadata["iteration"])
    if iteration >= t.iters and rank0:
        log.info("iteration %d already reaches train.iters = %d: nothing to train (raise train.iters to go on)",
                 iteration, t.iters)

    writer = _writes_metrics(run)
    callbacks = []
    if writer:
        names = (list(cfg.logging.callbacks) + (["tensorboard"] if cfg.logging.tensorboard else [])
                 + (["wandb"] if cfg.logging.wandb else []))
        callbacks = [registry("train callback").get(name).build(cfg) for name in dict.fromkeys(names)]

    train_batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, consumed)
    result = TrainResult(cfg)
    display = ProgressDisplay(cfg, iteration, enabled=progress and writer, on_gpu=run.device.type == "cuda")
    saver = None
    if cfg.ckpt.async_save and cfg.ckpt.save:
        from mtl.ckpt import AsyncSaver

        saver = AsyncSaver()

    def say(text: str) -> None:
        if display.mode != "none":
            display.message(text)
        elif writer:
            log.info("%s", text)

    def committed(step: int) -> None:
        say(f"saved checkpoint {iteration_dir(cfg.ckpt.save, step)}")
        if cfg.ckpt.keep_last and rank0:  # the save has just committed
            prune_checkpoints(cfg.ckpt.save, cfg.ckpt.keep_last)

    def finish_async_save() -> None:
        in_flight = saver.in_flight
        if saver.wait() is not None:
            committed(in_flight)

    def checkpoint(step: int) -> None:
        if not cfg.ckpt.save:
            return
        if saver is not None:
            finish_async_save()
        save_checkpoint(cfg, run.topology, run.chunks, run.optimizer, iteration=step,
                        consumed_samples=consumed, scaler_state=scaler.state_dict(), saver=saver)
        if saver is None:
            committed(step)
        else:
            say(f"saving checkpoint {iteration_dir(cfg.ckpt.save, step)} in the background")

    watch = LossWatch(run.chunks, run.topology.is_last_stage, run.device)
    last_saved, last_save_time = iteration, time.monotonic()
    try:
        with StopRequest(announce=rank0) as stop, ManualGC(t.gc_interval) as collector:
            micro = train_batches.take(t.num_micro_batches) if iteration < t.iters else []
            data_error = None  # reading the next step's batches failed: raised when that step starts
            while iteration < t.iters:
                if data_error is not None:
                    raise data_error
                began = time.perf_counter()
                lr = learning_rate(t, iteration)
                watch.reset()
                try:
                    pending = queue_train_step(cfg, run.topology, run.chunks, run.optimizer,
                                               _chunk_iterators(micro, len(run.chunks)), scaler, lr, run.device)
                    # The next step's batches are read and copied while the device still
                    # works on this one (their copies queue behind it); then the host waits.
                    # A read error belongs to the next step: this one still logs and saves.
                    try:
                        micro = train_batches.take(t.num_micro_batches) if iteration + 1 < t.iters else []
                    except torch.cuda.OutOfMemoryError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - re-raised unchanged before the next step
                        data_error = exc
                    collector.maybe_collect(iteration + 1)  # while the device works on this step
                    step = pending.result()
                except torch.cuda.OutOfMemoryError as exc:
                    raise out_of_memory_error(cfg, exc, iteration + 1, run.topology.rank) from exc
                if run.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - began
                iteration += 1
                consumed += t.global_batch_size
                result.losses[iteration] = step.loss
                overflow = scaler.dynamic and step.skipped  # fp16: the loss scaler's business
                interval_due = (cfg.ckpt.interval_minutes > 0
                                and time.monotonic() - last_save_time >= 60 * cfg.ckpt.interval_minutes)
                agreed = _agree(run, stop.received is not None,
                                origin=not overflow and watch.fired(),
                                loss_bad=not overflow and run.topology.is_last_stage and not math.isfinite(step.loss),
                                grad_bad=not overflow and not math.isfinite(step.grad_norm),
                                time_due=interval_due)
                if agreed.bad:
                    result.bad_steps += 1
                    message = _bad_step_message(agreed, step.grad_norm, iteration)
                    if result.bad_steps > t.skip_bad_steps:
                        allowed = (f"more than train.skip_bad_steps = {t.skip_bad_steps}" if t.skip_bad_steps
                                   else "set train.skip_bad_steps = N to skip up to N such steps")
                        raise NonFiniteError(
                            f"{message}; the run stopped without saving ({allowed}). Last good checkpoint: "
                            f"{_last_good_checkpoint(cfg, start.directory)}")
                    if rank0:
                        log.warning("%s: step skipped (%d of at most train.skip_bad_steps = %d)", message,
                                    result.bad_steps, t.skip_bad_steps)
                logged = iteration % cfg.logging.interval == 0 or iteration == t.iters
                # routers' aux/z losses and dropped tokens since the last logged step (a
                # collective, so every rank asks, only when logging)
                experts = moe_step_metrics(run.chunks, run.topology) if logged else {}  # {} without experts
                if writer:
                    metrics = {"loss": step.loss, "lr": lr, "grad_norm": step.grad_norm,
                               "skipped_steps": scaler.skipped_steps, "bad_steps": result.bad_steps,
                               "loss_scale": scaler.scale, **throughput(cfg, elapsed), **experts}
                    if logged:
                        for cb in callbacks:
                            cb.on_step(iteration, metrics)
                    display.step(iteration, metrics, logged)
                if t.eval_interval and iteration % t.eval_interval == 0:
                    result.eval_losses[iteration] = evaluate(run, iteration, callbacks, say if writer else None)
                if (cfg.ckpt.interval and iteration % cfg.ckpt.interval == 0) or agreed.time_due:
                    checkpoint(iteration)
                    last_saved, last_save_time = iteration, time.monotonic()
                if agreed.stop:
                    result.stopped_by = "signal"
                    break
                if t.exit_interval and iteration % t.exit_interval == 0:
                    result.stopped_by = "exit_interval"
                    break
            # still under the handlers: a second Ctrl-C during this save aborts it (never committed)
            if cfg.ckpt.save and cfg.ckpt.save_on_exit and last_saved != iteration:
                checkpoint(iteration)
            if saver is not None:
                finish_async_save()
    except BaseException:
        # an exception in a step (or a second Ctrl-C): save nothing; a save in flight is never
        # committed, so ckpt.save's 'latest' still names the last complete checkpoint
        display.close()
        for cb in callbacks:
            cb.close()
        watch.remove()
        raise
    display.close()
    watch.remove()
    for chunk in run.chunks:  # parallel.overlap_param_gather: hand back complete parameters
        chunk.finish_param_sync()
    for cb in callbacks:
        cb.close()
    result.final_iteration = iteration
    result.skipped_steps = scaler.skipped_steps
    result.config = cfg
    result.run = run
    return result


def evaluate(run: Run, iteration: int, callbacks: list, show=None) -> float:
    cfg = run.config
    valid = MicroBatches(run.datasets["valid"], cfg, run.topology, run.device,
                         consumed_samples=0)
    losses = []
    for _ in range(cfg.train.eval_iters):
        micro = valid.take(cfg.train.num_micro_batches)
        losses.append(eval_step(cfg, run.topology, run.chunks, _chunk_iterators(micro, len(run.chunks)), run.device))
    loss = sum(losses) / len(losses)
    metrics = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
    for cb in callbacks:
        cb.on_eval(iteration, metrics)
    if show is not None:
        show(f"eval at step {iteration}: loss {loss:.4f} | ppl {metrics['val_ppl']:.2f}")
    return loss
