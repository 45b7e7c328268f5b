"""Run a function on N CPU processes joined by a gloo process group; used by the test suites.

    results = run_distributed(fn, world_size=2, args=(...))   # fn(*args) on every rank
    join_fake_group(rank=0, world_size=2)   # this one process as a rank whose collectives move nothing

``fn`` must be defined at module level. It travels to the spawned processes by reference
(module name, file, qualified name), so test modules that pytest imported under a name
that is not on ``sys.path`` (``--import-mode=importlib``) work too. Each rank's return value comes back, in rank order;
an exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtl.core.errors import ParallelError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _function_ref(fn: Callable) -> tuple[str, str | None, str]:
    module = sys.modules.get(fn.__module__)
    return fn.__module__, getattr(module, "__file__", None), fn.__qualname__


def _resolve_function(ref: tuple[str, str | None, str]) -> Callable:
    """Import the module of ``fn`` by name, or from its file when the name is not importable."""
    module_name, file, qualname = ref
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if file is None:
            raise
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn_ref: tuple, args: tuple, backend: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # the CI machine has 2 cores for up to 4 ranks
    result: Any
    try:
        fn = _resolve_function(fn_ref)
        if backend == "nccl":  # one GPU per rank, as torchrun would place them
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = ("ok", fn(*args))
    except BaseException:  # report any failure to the parent, with the rank that raised it
        result = ("error", f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            _leave_together(backend)
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _leave_together(backend: str) -> None:
    """Wait for every rank before tearing the group down: a rank that destroys its gloo
    connections while a peer still uses them can abort that peer ("terminate called without
    an active exception"). A rank that failed still arrives here, so this does not hang on
    failures; should a peer be stuck elsewhere, gloo's monitored barrier gives up."""
    try:
        if backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        else:
            dist.barrier()
    except RuntimeError as exc:  # a peer failed: its own error is what the caller gets
        print(f"[rank {dist.get_rank()}] leaving without the others: {exc}", file=sys.stderr, flush=True)


def run_distributed(fn: Callable, world_size: int, args: tuple = (), backend: str = "gloo") -> list[Any]:
    """``fn(*args)`` on ``world_size`` spawned ranks; ``backend="nccl"`` puts rank r on cuda:r."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ParallelError(
            f"run_distributed: nccl with {world_size} ranks needs {world_size} GPUs, found "
            f"{torch.cuda.device_count()}; use backend='gloo' on CPU"
        )
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, _function_ref(fn), args, backend),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [payload for status, payload in results if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [payload for _, payload in results]


def join_fake_group(rank: int, world_size: int) -> None:
    """Initialise torch's fake process group in this process as rank ``rank`` of ``world_size``,
    as a launcher would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` 0), before mtl's setup builds its
    groups over it. Every collective returns at once without touching data: the code takes the
    path it takes on NCCL (which gloo's lack of reduce-scatter changes) and one process does one
    rank's work, but received tensors hold garbage."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ParallelError(f"join_fake_group: rank {rank} is not in 0..{world_size - 1}")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
