"""Starting torch.distributed from the launcher's environment (torchrun or SLURM)."""

from __future__ import annotations

import datetime
import os
import re

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


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``.

    SLURM compresses lists as ``prefix[ranges]suffix`` items joined by commas; the first
    item's first range start is the first node (zero padding kept)."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"SLURM_NODELIST={nodelist!r} is not a node list SLURM writes; set MASTER_ADDR yourself")
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return f"{prefix}{first}{suffix}"


def _rendezvous_from_slurm() -> None:
    """SLURM without torchrun: the first node of the job hosts the store."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    os.environ.setdefault("MASTER_ADDR", first_slurm_host(nodelist) if nodelist else "127.0.0.1")
    # a port derived from the job and step ids, so jobs (and steps of one job) sharing a node
    # do not collide
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    step = os.environ.get("SLURM_STEP_ID", "0")
    step = int(step) if step.isdigit() else 0
    os.environ.setdefault("MASTER_PORT", str(20000 + (job + step) % 20000))


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
        if "MASTER_ADDR" not in os.environ:
            _rendezvous_from_slurm()
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=dev if use_cuda else None,
            store=attempt_store(rank, world_size, timeout),
        )
    return rank, world_size, dev


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """Under torchrun, the rendezvous store of this restart attempt; None elsewhere (env://).

    torchrun's agent keeps hosting one TCPStore across the restarts ``--max-restarts``
    allows, and the workers of a later attempt would read the first attempt's keys (the dead
    workers' addresses): gloo then fails with ``connectFullMesh ... Connection refused``, or
    waits forever. Prefixing every key with ``TORCHELASTIC_RESTART_COUNT`` gives each attempt
    its own namespace in the same store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    # the agent hosts the store (torchrun's default): every worker is a client; otherwise
    # rank 0 hosts it, a new one each attempt
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=not agent_store and rank == 0, timeout=timeout, wait_for_workers=False,
    )
    return dist.PrefixStore(f"mtl/attempt_{attempt}", store)
