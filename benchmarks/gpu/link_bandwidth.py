"""How fast the GPUs of one host exchange data, with the collectives and sizes mtl's layouts use.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu/link_bandwidth.py

Per collective, on the reference model's tensors (bf16): the all-gather and reduce-scatter of
sequence parallelism (a ``[2048, 4, 2048]`` activation, 32 MiB gathered), the k/v exchange of
context parallelism at sequence 8192, and a data-parallel gradient all-reduce (256 MB of fp32),
each timed over back-to-back calls with CUDA events. Prints the time per call and the bus
bandwidth in nccl-tests' convention (what each GPU's link carries, so the figures compare
across world sizes); ``nvidia-smi topo -m`` before it says how the GPUs are linked (NV# =
NVLink, PIX/PHB/SYS = PCIe). Whether a layout's communication can hide behind its compute
starts from these numbers: ``ranks_alone.sh`` gives the compute side.
"""

from __future__ import annotations

import os
import subprocess

import torch
import torch.distributed as dist

from profile_step import cuda_ms_per_call

MB = 1 << 20


def _time_ms(fn, iters: int = 20) -> float:
    """ms per call (``profile_step.cuda_ms_per_call``), every rank starting together."""
    dist.barrier()
    return cuda_ms_per_call(fn, iters=iters)


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
        print(topo.stdout or topo.stderr, flush=True)
    rows = []

    def gather_scatter(name: str, full_numel: int, dtype: torch.dtype) -> None:
        full = torch.randn(full_numel, device=device).to(dtype)
        part = torch.empty(full_numel // world, dtype=dtype, device=device)
        size = full.numel() * full.element_size()
        ms = _time_ms(lambda: dist.all_gather_into_tensor(full, part))
        rows.append((f"all-gather, {name}", size, ms, size * (world - 1) / world))
        ms = _time_ms(lambda: dist.reduce_scatter_tensor(part, full))
        rows.append((f"reduce-scatter, {name}", size, ms, size * (world - 1) / world))

    # sequence parallelism: one activation of the reference model, gathered
    gather_scatter("SP activation [2048, 4, 2048]", 2048 * 4 * 2048, torch.bfloat16)
    # context parallelism at seq 8192, micro-batch 1: every rank's stacked k/v, 16 heads of 128
    gather_scatter("CP k/v [8192, 2, 1, 16, 128]", 8192 * 2 * 16 * 128, torch.bfloat16)
    grads = torch.randn(64 * MB, device=device)
    size = grads.numel() * 4
    ms = _time_ms(lambda: dist.all_reduce(grads), iters=10)
    rows.append(("all-reduce, DP gradient bucket (fp32)", size, ms, size * 2 * (world - 1) / world))
    if world == 2:  # the ring's step: each rank sends one block to its peer and receives one
        block = torch.randn(8192 * 16 * 128, device=device).to(torch.bfloat16)
        recv = torch.empty_like(block)
        peer = 1 - rank

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, block, peer), dist.P2POp(dist.irecv, recv, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        size = block.numel() * 2
        rows.append(("send+recv both ways, CP ring block (k and v of 4096 tokens)", size, _time_ms(exchange), size))
    if rank == 0:
        print(f"{world} GPUs ({torch.cuda.get_device_name(device)}), torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("| collective | MiB | ms per call | bus GB/s |")
        print("|---|---|---|---|")
        for name, size, ms, bus_bytes in rows:
            print(f"| {name} | {size / MB:.1f} | {ms:.3f} | {bus_bytes / ms / 1e6:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
