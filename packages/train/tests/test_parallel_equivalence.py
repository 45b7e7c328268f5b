"""Every parallel layout trains like one process: same losses for 3 steps, same gradients
(gathered to full shape) at the last step. fp32 on CPU with gloo; tolerances are in
``mtl.train.testing`` (the GPU check, benchmarks/gpu/equivalence_nccl.py, uses the same)."""

import pytest

from mtl.parallel.testing import run_distributed
from mtl.train.testing import LAYOUTS, compare_with_reference, run_layout, run_tiny


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(run_tiny, 1, args=([],))
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference):
    assert reference["losses"] and reference["grads"]
    compare_with_reference(layout, run_layout(layout), reference)
