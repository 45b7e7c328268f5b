"""Starting the process group from a launcher's environment: torchrun's variables, and
SLURM's (srun without torchrun), including the rendezvous address from the node list."""

import json
import os
import random
import socket
import subprocess
import sys

import pytest
from mtl.parallel.distributed import first_slurm_host, launcher_env


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


# What one srun task runs: join the group from SLURM's variables, all-reduce, report.
SRUN_TASK = """
import json, os, torch, torch.distributed as dist
from mtl.parallel.distributed import init_distributed
rank, world, device = init_distributed("cpu")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(json.dumps([rank, world, device.type, total.item(), os.environ["MASTER_ADDR"]]))
dist.destroy_process_group()
"""


def _free_port_in_job_range() -> int:
    """A free port of the form 20000 + job id + step id (what the rendezvous derives)."""
    for _ in range(100):
        port = random.randrange(20001, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port between 20000 and 32000")


def test_srun_without_torchrun_joins_one_group():
    """Two processes with only SLURM's variables (as srun starts them) form one group."""
    port = _free_port_in_job_range()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(port - 20001), SLURM_STEP_ID="1",
               OMP_NUM_THREADS="1")
    tasks = [
        subprocess.Popen([sys.executable, "-c", SRUN_TASK], env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [task.communicate(timeout=120) for task in tasks]
    for task, (out, err) in zip(tasks, outputs):
        assert task.returncode == 0, err[-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results == [[0, 2, "cpu", 3.0, "localhost"], [1, 2, "cpu", 3.0, "localhost"]]
