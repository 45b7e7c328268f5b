"""``parallel.overlap_layer_comm``: in a compiled layer, collectives start before compute that
does not need them and are waited on after it, as the code writes them, so the transfer can
run beside that compute: sequence parallelism's backward reduce-scatter beside the weight-
gradient GEMM (``gathered_linear``), the all-gather of cp k/v beside the own block's attention.
Read from the code inductor generates for the tiny model's layer (one process as rank 0 of two
over torch's fake process group, which takes the collectives NCCL would and moves no data; on
the CPU, and on a GPU where there is one). Without the key, inductor's peak-memory ordering
moves each start to its wait.

The numbers are not compared here: the fake group's collectives leave their outputs
uninitialised. test_compile.py runs tp=2 + sp and cp=2 with all-gathered k/v compiled with the
key on, over gloo, against an eager one-process run."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    from mtl.train.testing import run_tiny
    if sys.argv[1] == "cuda":
        import torch
        torch.cuda.set_device(0)
    run_tiny(sys.argv[2:] + [f"train.device='{sys.argv[1]}'", "train.compile=true", "model.num_layers=1",
                             "train.iters=2"], False)
""")

LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_allgather": ["parallel.cp=2", "parallel.cp_comm_type='all_gather'"],
}
# (collective, compute that may run beside it) in inductor's generated code: the backward's
# weight-gradient GEMM beside sequence parallelism's reduce-scatter, the own block's attention
# beside the cp gather
OVERLAPS = {"tp2_sp": ("reduce_scatter_tensor", r"extern_kernels\.mm\("),
            "cp2_allgather": ("all_gather_into_tensor", r"extern_kernels\.bmm\(")}


def _run(layout: str, overlap: bool, device: str) -> list[str]:
    """The generated code's lines (inductor's output_code log)."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, device, *LAYOUTS[layout], f"parallel.overlap_layer_comm={str(overlap).lower()}"],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "TORCH_LOGS": "output_code"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line.split("[__output_code]", 1)[1] for line in proc.stderr.splitlines() if "[__output_code]" in line]


def _work_between_start_and_wait(code: list[str], collective: str, work: str) -> list[int]:
    """For each start of ``collective`` in ``code``: how many ``work`` calls come before its wait."""
    counts = []
    for i, line in enumerate(code):
        started = re.match(rf"\s*(buf\d+) = torch\.ops\._c10d_functional\.{collective}\.default\(", line)
        if not started:
            continue
        buf, n = started.group(1), 0
        for later in code[i + 1:]:
            if re.search(rf"_c10d_functional\.wait_tensor\.default\({buf}\)", later):
                break
            n += bool(re.search(work, later))
        counts.append(n)
    return counts


# CUDA where there is one: inductor's GPU code is what runs in training
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_start_before_and_wait_after_independent_compute(layout, device):
    collective, work = OVERLAPS[layout]
    code_on = _run(layout, True, device)
    code_off = _run(layout, False, device)
    on = _work_between_start_and_wait(code_on, collective, work)
    off = _work_between_start_and_wait(code_off, collective, work)
    assert on and off, f"no {collective} in the generated code"
    assert any(on), f"overlap on: nothing runs beside any {collective} ({on})"
    assert not any(off), f"overlap off: expected each {collective} waited at once ({off})"
