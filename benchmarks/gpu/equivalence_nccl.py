"""The CPU equivalence tests, on GPUs with NCCL: every layout that fits the visible GPUs
against one GPU, same tiny model and tolerances as packages/train/tests.

    python3 benchmarks/gpu/equivalence_nccl.py      # prints one line per layout, exits 1 on a failure
"""

import sys

import torch

from mtl.parallel.testing import run_distributed
from mtl.train.testing import LAYOUTS, compare_with_reference, run_layout, run_tiny

CUDA = ["train.device='cuda'"]


def main() -> int:
    gpus = torch.cuda.device_count()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    (reference,) = run_distributed(run_tiny, 1, args=(CUDA,), backend="nccl")
    failed = 0
    for layout, (world, _) in LAYOUTS.items():
        if world > gpus:
            print(f"{layout:12s} skipped (needs {world} GPUs)", flush=True)
            continue
        try:
            diffs = compare_with_reference(layout, run_layout(layout, CUDA, backend="nccl"), reference)
            print(f"{layout:12s} PASS  loss rel diff {diffs['loss_rel_diff']:.2e}  "
                  f"max grad abs diff {diffs['grad_abs_diff']:.2e}", flush=True)
        except Exception as err:  # a rank's error is a RuntimeError: report it, check the rest
            failed += 1
            print(f"{layout:12s} FAIL  {str(err)[:400]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
