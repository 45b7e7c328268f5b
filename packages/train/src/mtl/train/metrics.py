"""Throughput as Megatron reports it: tokens/s, TFLOP/s per GPU (the model family's FLOP
count, Megatron's formula for ``gpt``), MFU against a measured peak, and peak memory."""

from __future__ import annotations

import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry


def iteration_flops(config: RunConfig) -> float | None:
    """Model FLOPs of one iteration, as the selected family counts them (None: it has no count)."""
    count = registry("model family").get(config.model.family).flops_per_iteration
    return count(config) if count is not None else None


def throughput(config: RunConfig, seconds_per_iteration: float) -> dict[str, float]:
    """TFLOP/s and MFU only when the model family counts its FLOPs."""
    tokens = config.train.global_batch_size * config.model.seq_length
    out = {
        "tokens_per_s": tokens / seconds_per_iteration,
        "tokens_per_s_per_gpu": tokens / seconds_per_iteration / config.parallel.world_size,
        "iter_s": seconds_per_iteration,
    }
    flops = iteration_flops(config)
    if flops is not None:
        out["tflops_per_gpu"] = tflops = flops / seconds_per_iteration / config.parallel.world_size / 1e12
        if config.logging.peak_tflops > 0:
            out["mfu"] = tflops / config.logging.peak_tflops
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def progress_line(step: int, total: int, metrics: dict, on_gpu: bool = False) -> str:
    """One plain line of the run's state. TFLOP/s per GPU and MFU only ``on_gpu`` (a CPU's
    rate against a GPU formula means nothing); tokens/s always."""
    parts = [f"step {step:>6}/{total}", f"loss {metrics['loss']:.4f}", f"lr {metrics['lr']:.3e}",
             f"grad {metrics['grad_norm']:.3f}", f"{metrics['tokens_per_s']:,.0f} tok/s"]
    if on_gpu and "tflops_per_gpu" in metrics:
        parts.append(f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU")
    parts.append(f"{metrics['iter_s'] * 1000:.0f} ms/it")
    if on_gpu and "mfu" in metrics:
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    if "mem_gb" in metrics:
        parts.append(f"{metrics['mem_gb']:.1f} GiB")
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    if metrics.get("bad_steps"):
        parts.append(f"bad steps skipped {metrics['bad_steps']}")
    return " | ".join(parts)
