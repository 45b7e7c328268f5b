"""The 2-rank pipeline cases on GPUs with NCCL (the CPU tests use gloo). Not collected by pytest.

    torchrun --nproc-per-node 2 packages/parallel/tests/pipeline/nccl_check.py

Rank 0 compares every case with the single-process CPU reference and exits non-zero on any
mismatch; the tolerance is looser than the gloo tests' 1e-6 because CUDA kernels round
differently from the CPU ones.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import pp_cases  # noqa: E402
import pp_toy  # noqa: E402

from mtl.parallel.distributed import init_distributed  # noqa: E402

TOL = 1e-5


def failures_of(case: dict, per_rank: list[dict]) -> list[str]:
    ref_losses, ref_grads = pp_toy.reference(case["num_layers"], case.get("tied", False), case["micro_batches"])
    problems = []
    for result in per_rank:
        if result["pp_rank"] == case["pp"] - 1:
            got = torch.tensor(result["losses"])
            if got.shape != (len(ref_losses),) or not torch.allclose(got, torch.tensor(ref_losses), atol=TOL, rtol=0):
                problems.append(f"losses {result['losses']} != {ref_losses}")
        for name, grad in result["grads"].items():
            if case.get("forward_only"):
                if grad is not None:
                    problems.append(f"forward_only left a gradient on {name}")
            elif not torch.allclose(grad, ref_grads[name], atol=TOL, rtol=0):
                error = (grad - ref_grads[name]).abs().max().item()
                problems.append(f"{name} on pp rank {result['pp_rank']}: max error {error:.2e}")
    return problems


def main() -> int:
    rank, world_size, device = init_distributed("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    results = {case["name"]: pp_cases.run_case(case, device) for case in pp_cases.CASES[world_size]}
    if world_size == 2:
        results["exchange"] = pp_cases.exchange_both_ways(device)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    failed = 0
    if rank == 0:
        for case in pp_cases.CASES[world_size]:
            problems = failures_of(case, [r[case["name"]] for r in gathered])
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {case['name']}", *problems[:4], sep="\n    ")
        if world_size == 2:
            # pp rank r sent 10 + r forward and 20 + r backward to its only peer, 1 - r.
            exchanges = [r["exchange"] for r in gathered]
            swapped = [e for e in exchanges if (e["from_prev"], e["from_next"]) != (11 - e["pp_rank"], 21 - e["pp_rank"])]
            failed += bool(swapped)
            print(f"{'FAIL' if swapped else 'ok  '} exchange both ways with one peer")
        print(f"{dist.get_backend()} on {torch.cuda.get_device_name(0)}, torch {torch.__version__}: {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
