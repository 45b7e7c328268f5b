"""The CPU equivalence tests, on GPUs with NCCL: every layout that fits the visible GPUs
against one GPU, with the tiny models and tolerances of packages/train/tests (the dense layouts
of test_parallel_equivalence, the MoE expert-parallel layouts of test_expert_parallel), and the
layouts only GPUs run (``GPU_LAYOUTS``: async TP).

Each layout starts its own processes and NCCL communicators (``run_distributed``), so pytest
itself runs as one plain process (no torchrun), on a machine with 2 or with 4 GPUs; layouts that
need more GPUs than are visible are skipped. After ``bash scripts/gpu/setup.sh`` (the plugins
register through the installed packages' entry points):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 -m pytest -m gpu tests/gpu/test_equivalence_nccl.py
    python3 -m pytest -m gpu tests/gpu/test_equivalence_nccl.py -k "pp2 or moe_ep2"   # only some layouts

On an H200 pair the 11 two-GPU layouts took 6.6 minutes (the two references ~35 s each, a
layout 15-40 s), so a call with little device time left names the layouts its change touches.
"""

import pytest
import torch

from mtl.parallel.testing import run_distributed
from mtl.train.testing import (GPU_LAYOUTS, LAYOUTS, LOSS_RTOL, MOE_LAYOUTS, MOE_TINY, SHARDED_LAYOUTS, assemble,
                               compare_with_reference, run_layout, run_tiny)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")]

MOE_GRAD_RTOL = 1e-5
CUDA = ["train.device='cuda'"]
DENSE = {**LAYOUTS, **SHARDED_LAYOUTS, **GPU_LAYOUTS}


def needs_gpus(world: int) -> None:
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")


@pytest.fixture(scope="module")
def dense_reference() -> dict:
    (reference,) = run_distributed(run_tiny, 1, args=(CUDA,), backend="nccl")
    return reference


@pytest.fixture(scope="module")
def moe_reference() -> dict:
    (reference,) = run_distributed(run_tiny, 1, args=([*MOE_TINY, *CUDA],), backend="nccl")
    return reference


@pytest.mark.parametrize("layout", list(DENSE))
def test_dense_layout_matches_one_gpu(layout, dense_reference):
    needs_gpus(DENSE[layout][0])
    compare_with_reference(layout, run_layout(layout, CUDA, backend="nccl"), dense_reference)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layout_matches_one_gpu(layout, moe_reference):
    """Losses within LOSS_RTOL; every gradient (experts gathered over ep) within MOE_GRAD_RTOL
    relative in L2 norm, the criterion of test_expert_parallel."""
    world, overrides = MOE_LAYOUTS[layout]
    needs_gpus(world)
    results = run_distributed(run_tiny, world, args=([*MOE_TINY, *CUDA, *overrides],), backend="nccl")
    last = next(r for r in results if r["last_stage"])
    for step, loss in moe_reference["losses"].items():
        assert abs(last["losses"][step] - loss) <= LOSS_RTOL * abs(loss), \
            f"moe_{layout}: losses {last['losses']} vs one GPU {moe_reference['losses']}"
    grads, ref = assemble(results), assemble([moe_reference])
    errors = {name: ((grads[name] - r).norm() / r.norm()).item() for name, r in ref.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= MOE_GRAD_RTOL, f"moe_{layout}: {worst} differs by {errors[worst]:.2e} relative"
