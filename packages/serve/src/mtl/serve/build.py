"""From command-line options to a ready engine: the process group for TP, the device, the model."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from mtl.core.device import parse_device
from mtl.core.errors import ConfigError
from mtl.serve.engine import Engine, EngineConfig
from mtl.serve.loading import DTYPES, load_checkpoint

SERVED_FAMILIES = ("gpt",)
CPU_KV_MEMORY = "512MiB"  # the pool's size on a CPU, where there is no free device memory to take a share of
GPU_KV_MEMORY = "0.8"  # of the GPU memory free after loading: the rest is activations and logits


def init_tp(tp: int) -> int:
    """This process's rank: 0 alone; under torchrun (WORLD_SIZE = tp) the process group's."""
    if tp == 1:
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise ConfigError(f"--tp {tp} needs {tp} processes: launch with torchrun --nproc-per-node {tp} "
                          f"$(which mtl) serve ... --tp {tp} (WORLD_SIZE is {world})")
    if not dist.is_initialized():
        # the other ranks wait in a broadcast for rank 0's next step, which an idle server may not
        # send for hours: the default collective timeout (10-30 min) would end the run
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(days=365))
    return dist.get_rank()


def distributed_device(device: str | None, tp: int) -> torch.device:
    """``--device`` (default: cuda when available); under TP each rank takes its LOCAL_RANK's GPU."""
    dev = parse_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if tp > 1:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return dev


def build_engine(checkpoint: str, *, device: torch.device, tp: int = 1, dtype: str | None = "auto",
                 kv_memory: str | None = None, tokenizer: str | None = None, tokenizer_model: str | None = None,
                 iteration: int | None = None, **engine_options) -> Engine:
    """The checkpoint's model on ``device`` (this rank's TP part) and an engine around it;
    ``dtype`` None keeps the stored precision, "auto" is bfloat16 on CUDA; ``engine_options``
    are EngineConfig's fields."""
    if tokenizer_model is not None and tokenizer is None:
        raise ConfigError("--tokenizer-model needs --tokenizer NAME (which tokenizer reads the file)")
    weights = (torch.bfloat16 if device.type == "cuda" else None) if dtype == "auto" else DTYPES.get(dtype)
    loaded = load_checkpoint(checkpoint, device=device, tp=tp, dtype=weights, tokenizer=tokenizer,
                             tokenizer_model=tokenizer_model, iteration=iteration)
    family = loaded.config.model.family
    if family not in SERVED_FAMILIES:  # the runner packs sequences into gpt's layers, with a paged cache
        raise ConfigError(f"{checkpoint}: model.family = '{family}': the engine serves {', '.join(SERVED_FAMILIES)} "
                          "checkpoints only; use `mtl generate CHECKPOINT --prompt TEXT` for this one")
    if loaded.tokenizer.vocab_size < loaded.config.model.vocab_size:
        raise ConfigError(f"the model's vocabulary has {loaded.config.model.vocab_size} tokens but the tokenizer "
                          f"has {loaded.tokenizer.vocab_size}; pass the tokenizer the model was trained with")
    kv = kv_memory or (GPU_KV_MEMORY if device.type == "cuda" else CPU_KV_MEMORY)
    return Engine(loaded, EngineConfig(kv_memory=kv, **engine_options), device)
