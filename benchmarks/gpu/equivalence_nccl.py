"""The CPU equivalence tests, on GPUs with NCCL: every layout that fits the visible GPUs
against one GPU, same tiny models and tolerances as packages/train/tests (the dense layouts
of test_parallel_equivalence, the MoE expert-parallel layouts of test_expert_parallel), and
the layouts only GPUs run (``GPU_LAYOUTS``: async TP).

    python3 benchmarks/gpu/equivalence_nccl.py      # prints one line per layout, exits 1 on a failure
    python3 benchmarks/gpu/equivalence_nccl.py pp2 pp2_vpp2 moe_ep2   # only the layouts named

Each layout starts its own processes and NCCL communicators (~10-20 s each on an H200 pair), so a
call with little device time left names the layouts its change touches.
"""

import sys

import torch

from mtl.parallel.testing import run_distributed
from mtl.train.testing import (GPU_LAYOUTS, LAYOUTS, LOSS_RTOL, MOE_LAYOUTS, MOE_TINY, assemble,
                               compare_with_reference, run_layout, run_tiny)

MOE_GRAD_RTOL = 1e-5

CUDA = ["train.device='cuda'"]


def main(selected: list[str]) -> int:
    dense = {**LAYOUTS, **GPU_LAYOUTS}
    known = [*dense, *(f"moe_{name}" for name in MOE_LAYOUTS)]
    unknown = [name for name in selected if name not in known]
    if unknown:
        print(f"unknown layout(s) {', '.join(unknown)}; the layouts are: {' '.join(known)}", file=sys.stderr)
        return 2
    wanted = set(selected or known)
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    (reference,) = run_distributed(run_tiny, 1, args=(CUDA,), backend="nccl")
    failed = 0
    for layout, (world, _) in dense.items():
        if layout not in wanted:
            continue
        failed += check(layout, world, gpus, lambda: compare_with_reference(
            layout, run_layout(layout, CUDA, backend="nccl"), reference))
    # the MoE model at its expert-parallel layouts (test_expert_parallel's model and tolerances)
    if not wanted & {f"moe_{name}" for name in MOE_LAYOUTS}:
        return 1 if failed else 0
    (moe_reference,) = run_distributed(run_tiny, 1, args=([*MOE_TINY, *CUDA],), backend="nccl")
    for layout, (world, overrides) in MOE_LAYOUTS.items():
        if f"moe_{layout}" not in wanted:
            continue
        failed += check(f"moe_{layout}", world, gpus, lambda: compare_moe(
            run_distributed(run_tiny, world, args=([*MOE_TINY, *CUDA, *overrides],), backend="nccl"), moe_reference))
    return 1 if failed else 0


def check(layout: str, world: int, gpus: int, compare) -> int:
    """Run one comparison and print its line; 1 if it failed."""
    if world > gpus:
        print(f"{layout:16s} skipped (needs {world} GPUs)", flush=True)
        return 0
    try:
        diffs = compare()
        print(f"{layout:16s} PASS  " + "  ".join(f"{k} {v:.2e}" for k, v in diffs.items()), flush=True)
        return 0
    except Exception as err:  # a rank's error is a RuntimeError: report it, check the rest
        print(f"{layout:16s} FAIL  {str(err)[:400]}", flush=True)
        return 1


def compare_moe(results: list[dict], reference: dict) -> dict:
    """Losses within LOSS_RTOL; every gradient (experts gathered over ep) within
    MOE_GRAD_RTOL relative in L2 norm, the criterion of test_expert_parallel."""
    last = next(r for r in results if r["last_stage"])
    loss_diff = max(abs(last["losses"][s] - v) / abs(v) for s, v in reference["losses"].items())
    if loss_diff > LOSS_RTOL:
        raise AssertionError(f"losses {last['losses']} vs one GPU {reference['losses']}")
    grads, ref = assemble(results), assemble([reference])
    errors = {name: ((grads[name] - r).norm() / r.norm()).item() for name, r in ref.items()}
    worst = max(errors, key=errors.get)
    if errors[worst] > MOE_GRAD_RTOL:
        raise AssertionError(f"{worst} differs by {errors[worst]:.2e} relative")
    return {"loss_rel_diff": loss_diff, "worst_grad_rel_l2": errors[worst]}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
