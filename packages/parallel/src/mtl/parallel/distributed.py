"""Starting torch.distributed from the launcher's environment (torchrun or SLURM)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or SLURM's variables; (0, 1, 0) if neither."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
        )
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", "0")),
        )
    return 0, 1, 0


def init_distributed(device: str = "auto", timeout_minutes: float = 10.0) -> tuple[int, int, torch.device]:
    """Initialise the default process group if the launcher started several processes.

    Returns (rank, world_size, device). NCCL on CUDA, gloo on CPU. A single process without a
    launcher runs without a process group at all."""
    rank, world_size, local_rank = launcher_env()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # SLURM without torchrun: first node hosts the store
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=dev if use_cuda else None,
        )
    return rank, world_size, dev
