"""The training loop: steps, logging, evaluation, checkpoints, SIGTERM and exit interval."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.log import get_logger
from mtl.core.plugins import registry
from mtl.train.batches import MicroBatches
from mtl.ckpt import prune_checkpoints
from mtl.train.checkpointing import checkpoint_format, load_checkpoint, save_checkpoint, starting_checkpoint
from mtl.train.lr_schedule import learning_rate
from mtl.train.metrics import progress_line, throughput
from mtl.train.precision import LossScaler
from mtl.train.setup import Run, setup
from mtl.train.step import eval_step, train_step

log = get_logger(__name__)


@dataclass
class TrainResult:
    config: RunConfig
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (last stage only)
    eval_losses: dict[int, float] = field(default_factory=dict)
    final_iteration: int = 0
    stopped_by: str = "iters"  # iters | exit_interval | signal
    skipped_steps: int = 0
    run: Run | None = None  # the model and optimizer as they ended, for inspection and tests


class _StopSignal:
    """Turns SIGTERM (a scheduler's preemption notice) into a flag the loop checks each step."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler, no flag
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def any_rank(self, device) -> bool:
        """True if any rank got the signal, so all ranks stop at the same step."""
        if not dist.is_initialized():
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)


def _writes_metrics(run: Run) -> bool:
    """Only the last pipeline stage's first rank logs (it has the loss)."""
    t = run.topology
    return t.is_last_stage and t.tp_rank == 0 and t.dp_rank == 0 and t.cp_rank == 0


def _chunk_iterators(micro_batches: list, num_chunks: int):
    return [iter(micro_batches) for _ in range(num_chunks)]


def train(config: RunConfig, progress: bool = True) -> TrainResult:
    if config.ckpt.async_save and config.ckpt.format != "zarr":
        raise ConfigError(f"ckpt.async_save = true is available for ckpt.format = 'zarr' only, "
                          f"not '{config.ckpt.format}'; set ckpt.async_save = false")
    if config.ckpt.save or config.ckpt.load:
        checkpoint_format(config)  # an unknown format fails here, before any work
    run = setup(config)
    cfg, t = run.config, run.config.train
    scaler = LossScaler.for_config(t)
    iteration, consumed = 0, 0
    source, full_resume = starting_checkpoint(cfg)
    if source is not None:
        metadata = load_checkpoint(cfg, run.topology, run.chunks, run.optimizer, source, load_optimizer=full_resume)
        if full_resume and not metadata.get("model_only"):
            iteration, consumed = metadata["iteration"], metadata["consumed_samples"]
            if scaler.dynamic and "loss_scaler" in metadata:
                scaler.load_state_dict(metadata["loss_scaler"])
            log.info("resumed from %s at iteration %d", source, iteration)
        else:
            log.info("weights from %s (its iteration %d); optimizer, schedule and data start at iteration 0",
                     source, metadata["iteration"])

    writer = _writes_metrics(run)
    callbacks = []
    if writer:
        names = list(cfg.logging.callbacks) + (["tensorboard"] if cfg.logging.tensorboard else [])
        callbacks = [registry("train callback").get(name).build(cfg) for name in dict.fromkeys(names)]

    train_batches = MicroBatches(run.datasets["train"], cfg, run.topology, run.device, consumed)
    result = TrainResult(cfg)
    saver = None
    if cfg.ckpt.async_save and cfg.ckpt.save:
        from mtl.ckpt import AsyncSaver

        saver = AsyncSaver()

    def checkpoint(step: int) -> None:
        if cfg.ckpt.save:
            save_checkpoint(cfg, run.topology, run.chunks, run.optimizer, iteration=step,
                            consumed_samples=consumed, scaler_state=scaler.state_dict(), saver=saver)
            if cfg.ckpt.keep_last and run.topology.rank == 0:
                prune_checkpoints(cfg.ckpt.save, cfg.ckpt.keep_last)

    last_saved = iteration
    with _StopSignal() as stop:
        while iteration < t.iters:
            start = time.perf_counter()
            lr = learning_rate(t, iteration)
            micro = train_batches.take(t.num_micro_batches)
            step = train_step(cfg, run.topology, run.chunks, run.optimizer,
                              _chunk_iterators(micro, len(run.chunks)), scaler, lr, run.device)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            iteration += 1
            consumed += t.global_batch_size
            result.losses[iteration] = step.loss
            if writer and (iteration % cfg.logging.interval == 0 or iteration == t.iters):
                if not math.isfinite(step.loss) and t.precision != "fp16":
                    log.warning("loss is %s at step %d", step.loss, iteration)
                metrics = {"loss": step.loss, "lr": lr, "grad_norm": step.grad_norm,
                           "skipped_steps": scaler.skipped_steps, "loss_scale": scaler.scale,
                           **throughput(cfg, elapsed)}
                for cb in callbacks:
                    cb.on_step(iteration, metrics)
                if progress:
                    print(progress_line(iteration, t.iters, metrics), flush=True)
            if t.eval_interval and iteration % t.eval_interval == 0:
                result.eval_losses[iteration] = evaluate(run, iteration, callbacks, progress and writer)
            if cfg.ckpt.interval and iteration % cfg.ckpt.interval == 0:
                checkpoint(iteration)
                last_saved = iteration
            if stop.any_rank(run.device):
                result.stopped_by = "signal"
                break
            if t.exit_interval and iteration % t.exit_interval == 0:
                result.stopped_by = "exit_interval"
                break
    if cfg.ckpt.save and cfg.ckpt.save_on_exit and last_saved != iteration:
        checkpoint(iteration)
    if saver is not None:
        saver.wait()
        if cfg.ckpt.keep_last and run.topology.rank == 0:  # the last save has just committed
            prune_checkpoints(cfg.ckpt.save, cfg.ckpt.keep_last)
    for chunk in run.chunks:  # parallel.overlap_param_gather: hand back complete parameters
        chunk.finish_param_sync()
    for cb in callbacks:
        cb.close()
    result.final_iteration = iteration
    result.skipped_steps = scaler.skipped_steps
    result.config = cfg
    result.run = run
    return result


def evaluate(run: Run, iteration: int, callbacks: list, show: bool) -> float:
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
    if show:
        print(f"eval at step {iteration}: loss {loss:.4f} | ppl {metrics['val_ppl']:.2f}", flush=True)
    return loss
