"""One training iteration (all micro-batches, gradient sync, clip, optimizer step) and one
evaluation pass, over any combination of tp/pp/vpp/cp/dp."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.models.moe import set_aux_loss_scale, update_expert_biases
from mtl.parallel.topology import Topology
from mtl.train.cuda_graphs import capture_or_check
from mtl.train.precision import DTYPES, LossScaler, autocast


@dataclass
class StepResult:
    loss: float  # mean over the global batch; NaN on ranks that are not the last stage
    grad_norm: float
    skipped: bool
    metrics: dict = field(default_factory=dict)  # the family's other loss metrics (e.g. mlm_accuracy), last stage


def _forward_step_factory(config: RunConfig, topology: Topology, device: torch.device, loss_scale: float):
    """The schedule's ``forward_step``: run a chunk on the next micro-batch, return its output
    and a loss function (used on the last stage only). The model family says how a batch
    becomes the forward's keywords and how the output becomes the loss (``ModelFamily``
    ``forward_inputs`` / ``loss``); without them, gpt's tokens and masked per-token mean."""
    stream_dtype = DTYPES[config.train.params_dtype]
    family = registry("model family").get(config.model.family)
    forward_inputs = family.forward_inputs or _token_inputs
    family_loss = family.loss or _masked_token_mean

    def forward_step(batches, model_chunk):
        batch = next(batches)
        with autocast(config.train.precision, device):
            output = model_chunk(**forward_inputs(batch))
        # The residual stream a stage hands to the next has the weights' dtype (fp32 weights
        # under autocast keep an fp32 stream; bf16 weights a bf16 one, as in one process); a
        # backend that returns another dtype is cast to it, so every split sends the same bytes.
        if not getattr(model_chunk, "post_process", False) and output.dtype != stream_dtype:
            output = output.to(stream_dtype)

        def loss_func(output):
            loss, metrics = family_loss(output, batch, topology)
            return loss * loss_scale, metrics

        return output, loss_func

    return forward_step


def _token_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["tokens"], "position_ids": batch["position_ids"], "labels": batch["labels"]}


def _masked_token_mean(per_token_loss: torch.Tensor, batch: dict[str, torch.Tensor], topology: Topology):
    """Mean over this micro-batch's tokens; the schedule divides by num_micro_batches and data
    parallelism averages, so the total is the mean over the global batch."""
    mask = batch["loss_mask"]
    loss = (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"loss": loss.detach()}


def _tensor_shape(config: RunConfig) -> tuple[int, ...]:
    """Shape of the activations passed between pipeline stages: [s/cp(/tp with SP), b, h], or
    the model family's (``ModelFamily.pipeline_tensor_shape``)."""
    family = registry("model family").get(config.model.family)
    if family.pipeline_tensor_shape is not None:
        return tuple(family.pipeline_tensor_shape(config))
    m, p = config.model, config.parallel
    seq = m.seq_length // p.cp
    if p.sequence_parallel:
        seq //= p.tp
    return (seq, config.train.micro_batch_size, m.hidden_size)


def _run_schedule(config, topology, chunks, batches_per_chunk, forward_step, forward_only):
    from mtl.parallel.pipeline import forward_backward


    def no_sync():
        import contextlib

        stack = contextlib.ExitStack()
        for chunk in chunks:
            stack.enter_context(chunk.no_sync())
        return stack

    return forward_backward(
        forward_step,
        batches_per_chunk,
        chunks,
        num_micro_batches=config.train.num_micro_batches,
        tensor_shape=_tensor_shape(config),
        dtype=DTYPES[config.train.params_dtype],  # what every stage sends: see forward_step
        topology=topology,
        forward_only=forward_only,
        no_sync_func=None if forward_only else no_sync,
    )


def _mean_metrics(loss_dicts: list[dict], topology: Topology, device: torch.device) -> dict[str, torch.Tensor] | None:
    """Each metric of the micro-batches ("loss", and what the family's loss adds) averaged,
    then over data- and context-parallel ranks (device scalars; None on a stage without the loss)."""
    if not topology.is_last_stage or not loss_dicts:
        return None
    names = list(loss_dicts[0])
    means = torch.stack([torch.stack([d[n].float() for d in loss_dicts]).mean() for n in names]).to(device)
    group = topology.group("dp_cp")
    if group is not None:
        dist.all_reduce(means, group=group)
        means /= dist.get_world_size(group)
    return dict(zip(names, means))


@dataclass
class PendingStep:
    """A training step whose work is queued on the device. ``result()`` reads the loss and
    gradient norm (the host waits for the step there) and records the step with the loss
    scaler; call it before the next step, whose loss scale it may change."""

    metrics: dict[str, torch.Tensor] | None
    grad_norm: torch.Tensor
    scaler: LossScaler

    def result(self) -> StepResult:
        metrics = {name: value.item() for name, value in (self.metrics or {}).items()}
        loss = metrics.pop("loss", float("nan"))
        grad_norm = self.grad_norm.item()
        return StepResult(loss=loss, grad_norm=grad_norm, skipped=self.scaler.update(not math.isfinite(grad_norm)),
                          metrics=metrics)


def queue_train_step(config: RunConfig, topology: Topology, chunks: list, optimizer, batches_per_chunk,
                     scaler: LossScaler, lr: float, device: torch.device) -> PendingStep:
    """Queue one iteration (forward/backward of every micro-batch, gradient sync, clipping,
    the update) without reading anything on the host; ``result()`` of what it returns waits."""
    from mtl.parallel.pipeline import allreduce_shared_embedding_grads

    if config.train.cuda_graphs:
        capture_or_check(config, chunks, device)  # before zero_grad: the capture's warm-up gradients go with it
    for chunk in chunks:
        chunk.zero_grad()
        if config.model.num_experts and scaler.dynamic:  # fp16: the routers' losses get the loss scale too
            set_aux_loss_scale(chunk, scaler.scale / config.train.num_micro_batches)
    forward_step = _forward_step_factory(config, topology, device, scaler.scale)
    loss_dicts = _run_schedule(config, topology, chunks, batches_per_chunk, forward_step, forward_only=False)
    for chunk in chunks:
        chunk.finish_grad_sync()
    allreduce_shared_embedding_grads(chunks, topology)
    if config.model.moe_router_expert_bias:  # aux-loss-free balancing: from this step's routing counts
        update_expert_biases(chunks, topology.group("dp_cp"))

    if scaler.scale != 1.0:  # the gradients the optimizer reads: whole, or its shards
        optimizer.scale_grads(1.0 / scaler.scale)
    max_norm = config.train.clip_grad if config.train.clip_grad > 0 else float("inf")
    for group in optimizer.param_groups:
        group["lr"] = lr
    # No host read before the update is queued: clipping and the skip of a non-finite step
    # happen on the device (clip_and_step); PendingStep.result() reads the norm and loss.
    metrics = _mean_metrics(loss_dicts, topology, device)
    loss = metrics["loss"] if metrics is not None else None
    grad_norm, _ = optimizer.clip_and_step(max_norm, skip=_loss_not_finite(loss, topology, device))
    return PendingStep(metrics, grad_norm, scaler)


def _loss_not_finite(loss: torch.Tensor | None, topology: Topology, device: torch.device) -> torch.Tensor:
    """1 on every rank where the step's loss is inf/NaN (a device scalar): such a step is
    skipped even when its gradient norm is finite (an inf loss at a masked token). Only the
    last pipeline stage has the loss; the other stages get its verdict over ``pp``."""
    bad = (~torch.isfinite(loss)).float() if loss is not None else torch.zeros((), device=device)
    group = topology.group("pp")
    if group is not None:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bad


@torch.no_grad()
def eval_step(config: RunConfig, topology: Topology, chunks: list, batches_per_chunk, device) -> dict[str, float]:
    """One evaluation batch: its mean ``loss`` and the family's other metrics (a classifier's
    accuracy); ``{"loss": nan}`` on a stage without the loss."""
    for chunk in chunks:
        chunk.eval()
    try:
        forward_step = _forward_step_factory(config, topology, device, 1.0)
        loss_dicts = _run_schedule(config, topology, chunks, batches_per_chunk, forward_step, forward_only=True)
    finally:
        for chunk in chunks:
            chunk.train()
    metrics = _mean_metrics(loss_dicts, topology, device)
    return {name: value.item() for name, value in metrics.items()} if metrics is not None else {"loss": float("nan")}
