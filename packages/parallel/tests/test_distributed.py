"""Starting the process group from a launcher's environment: torchrun's variables, and
SLURM's (srun without torchrun), including the rendezvous address from the node list."""

import os
import random
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtl.parallel.distributed import first_slurm_host, init_distributed, launcher_env


@pytest.mark.parametrize("nodelist, host", [
    ("gpu17", "gpu17"),
    ("node[03-05,9]", "node03"),
    ("node[003-005],login1", "node003"),
    ("a-[1-2]-ib", "a-1-ib"),
    ("alpha,beta", "alpha"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_bad_node_list_is_named():
    with pytest.raises(ValueError, match=r"SLURM_NODELIST='\[1-2\]'"):
        first_slurm_host("[1-2]")


def test_torchrun_variables_win_over_slurm(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert launcher_env() == (3, 8, 1)


def _srun_task(rank: int, port: int, out_dir: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                      SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(port - 20000))
    got_rank, world, device = init_distributed("cpu")
    total = torch.tensor([float(got_rank + 1)])
    dist.all_reduce(total)
    torch.save((got_rank, world, device.type, total.item(), os.environ["MASTER_ADDR"]), f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def _free_port_in_job_range() -> int:
    """A free port of the form 20000 + job id (what the rendezvous derives from SLURM_JOB_ID)."""
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port between 20000 and 32000")


def test_srun_without_torchrun_joins_one_group():
    port = _free_port_in_job_range()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_srun_task, args=(port, out), nprocs=2, start_method="spawn")
        results = [torch.load(f"{out}/{r}.pt") for r in range(2)]
    assert results == [(0, 2, "cpu", 3.0, "localhost"), (1, 2, "cpu", 3.0, "localhost")]
