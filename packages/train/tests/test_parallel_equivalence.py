"""Every parallel layout trains like one process: same losses for 3 steps, same gradients
(gathered to full shape) at the last step. fp32 on CPU with gloo."""

import math

import pytest
import torch

from mtl.parallel.testing import run_distributed

from mtl.train.testing import assemble, run_tiny

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "dp2": (2, []),
    "dp2_distopt": (2, ["parallel.distributed_optimizer=true"]),
    "cp2": (2, ["parallel.cp=2"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
}
LOSS_TOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(run_tiny, 1, args=([],))
    return result["losses"], assemble([result])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference):
    ref_losses, ref_grads = reference
    world, overrides = LAYOUTS[layout]
    results = run_distributed(run_tiny, world, args=(overrides, "distopt" not in layout))
    losses = next(r["losses"] for r in results if r["last_stage"])
    assert list(losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert math.isfinite(loss)
        assert abs(loss - ref_losses[step]) < LOSS_TOL * max(1.0, abs(ref_losses[step])), (step, loss, ref_losses[step])
    if "distopt" in layout:
        return  # gradients are reduce-scattered: each rank holds only its shard's; losses cover it
    grads = assemble(results)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m: f"{layout} {name}: {m}")
