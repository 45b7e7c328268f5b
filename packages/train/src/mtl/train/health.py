"""Bad steps: a NaN/Inf loss or gradient norm, found where it first appears.

``LossWatch`` hooks the last pipeline stage's model output (the per-token loss) and keeps a
device-side flag that any micro-batch of the step produced a non-finite loss, so the rank
where the trouble started is known although the reported loss is already averaged over
data-parallel ranks. Reading it costs nothing extra: the step's loss is read anyway."""

from __future__ import annotations

import torch

from mtl.core.errors import MtlError


class NonFiniteError(MtlError):
    """A step produced a NaN/Inf loss or gradient norm (more of them than train.skip_bad_steps allows)."""


class LossWatch:
    def __init__(self, chunks: list, is_last_stage: bool, device: torch.device):
        self._flag = torch.zeros((), dtype=torch.bool, device=device)
        self._handles = []
        if is_last_stage:
            last = chunks[-1]
            self._handles.append(getattr(last, "module", last).register_forward_hook(self._hook))

    def _hook(self, module, args, output) -> None:
        if torch.is_tensor(output) and output.is_floating_point():
            self._flag |= ~torch.isfinite(output.detach()).all()

    def reset(self) -> None:
        self._flag.zero_()

    def fired(self) -> bool:
        return bool(self._flag.item())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class OutOfMemory(MtlError):
    """CUDA ran out of memory in a step; the message names the snapshot and the keys that lower memory."""


def memory_advice(config) -> list[str]:
    """Config changes that lower memory per GPU, for this config (most effective first)."""
    t, p = config.train, config.parallel
    advice = []
    if t.micro_batch_size > 1:
        advice.append(f"train.micro_batch_size = {t.micro_batch_size // 2} (now {t.micro_batch_size}; the global "
                      f"batch stays {t.global_batch_size}, with more micro-batches)")
    if t.recompute != "full":
        advice.append(f"train.recompute = \"{'selective' if t.recompute == 'none' else 'full'}\" (now \"{t.recompute}\": "
                      "recompute activations in backward)")
    if p.dp > 1 and not p.distributed_optimizer:
        advice.append("parallel.distributed_optimizer = true (shard optimizer state over the data-parallel ranks)")
    advice.append(f"parallel.tp = {p.tp * 2} or parallel.pp = {p.pp * 2} (split the model over more GPUs)")
    if p.tp > 1 and not p.sequence_parallel:
        advice.append("parallel.sequence_parallel = true (shard activations over the TP ranks)")
    if t.precision == "fp32":
        advice.append("train.precision = \"bf16\"")
    return advice


def out_of_memory_error(config, exc: BaseException, iteration: int, rank: int) -> OutOfMemory:
    """Dump a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) into logging.dir and
    build the error naming it and the keys that would lower memory."""
    import os  # noqa: PLC0415

    lines = [f"CUDA out of memory in step {iteration} on rank {rank}"]
    try:
        used = torch.cuda.max_memory_allocated() / 2**30
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        lines[0] += f" (peak {used:.1f} GiB allocated of {total:.1f} GiB)"
    except Exception:  # noqa: BLE001 - the message matters more than the numbers
        pass
    try:
        os.makedirs(config.logging.dir, exist_ok=True)
        path = os.path.join(config.logging.dir, f"oom_snapshot_rank{rank}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        lines.append(f"memory snapshot: {path} (drag it into https://pytorch.org/memory_viz)")
    except Exception as dump_error:  # noqa: BLE001
        lines.append(f"(no memory snapshot: {dump_error})")
    lines.append("settings that lower memory per GPU: " + "; ".join(memory_advice(config)))
    lines.append(f"torch said: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return OutOfMemory("\n".join(lines))
