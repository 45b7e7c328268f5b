"""``train.compile``: each transformer layer compiled as one region gives the eager
one-process numbers at every layout, with no graph break inside a layer (dynamo's own
counters). Context parallelism's ring exchange is the one region left eager on purpose."""

from __future__ import annotations

import pytest

from mtl.parallel.testing import run_distributed
from mtl.train.testing import LAYOUTS, compare_with_reference, run_tiny


def _run_compiled(overrides: list[str]) -> dict:
    from torch._dynamo.utils import counters

    from mtl.train.compile import graph_breaks

    counters.clear()
    result = run_tiny([*overrides, "train.compile=true"])
    result["graph_breaks"] = graph_breaks()
    result["layer_graphs"] = _layer_graphs()
    return result


def _layer_graphs() -> int:
    """How many compiled graphs dynamo holds for a transformer layer's compiled call: under
    ``train.compile`` the layer's deferred step (``residual_deferral.py``)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from mtl.models.gpt.residual_deferral import DeferredResidualStep

    return len(_debug_get_cache_entry_list(DeferredResidualStep.forward.__code__))


@pytest.fixture(scope="module")
def eager_reference() -> dict:
    return run_tiny([])


def test_one_process_compiled_equals_eager_in_one_graph(eager_reference):
    compiled = _run_compiled([])
    assert compiled["graph_breaks"] == {}
    assert compiled["layer_graphs"] == 1  # four layers of one shape: traced once, no recompiles
    compare_with_reference("compiled", [compiled], eager_reference)


# Collectives inside the layer (tp + sp), overlapped parameter gathers and selective recompute
# (dp + distributed optimizer), full recompute over interleaved pipeline chunks, and context
# parallelism (the ring, and all-gathered k/v).
# name -> (layout, extra overrides)
CASES = {
    "tp2_sp": ("tp2_sp", []),
    "dp2_distopt": ("dp2_distopt", ["parallel.overlap_param_gather=true", "train.recompute=selective"]),
    "pp2_vpp2": ("pp2_vpp2", ["train.recompute=full"]),
    "cp2": ("cp2", []),
    # k/v all-gathered: the whole attention compiles with the layer
    "cp2_allgather": ("cp2_allgather", []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_layout_equals_eager_one_process(name, eager_reference):
    layout, extra = CASES[name]
    world, overrides = LAYOUTS[layout]
    results = run_distributed(_run_compiled, world, args=([*overrides, *extra],))
    compare_with_reference(f"{name} compiled", results, eager_reference)
    for rank, result in enumerate(results):
        breaks = result["graph_breaks"]
        if layout == "cp2":  # the ring runs eagerly by design (torch.compiler.disable)
            assert breaks and all("_ring_attention" in reason for reason in breaks), breaks
        else:
            assert breaks == {}, f"rank {rank}: {breaks}"
        assert result["layer_graphs"] == 1, f"rank {rank}: the layer traced {result['layer_graphs']} times"


def test_norm_grad_split_is_about_one_per_sm():
    """Rows per split of a norm's weight-gradient sum: the largest power of two <= tokens / SMs,
    within [16, 128] (the H100 reference layer: 8192 tokens, 132 SMs -> 32 rows, 256 splits)."""
    from mtl.train.compile import norm_grad_split_rows

    assert norm_grad_split_rows(8192, 132) == 32
    assert norm_grad_split_rows(16384, 132) == 64
    assert norm_grad_split_rows(2048, 132) == 16  # 15 per SM: not below inductor's own floor
    assert norm_grad_split_rows(1 << 20, 132) == 128


def test_inductor_options_only_touch_cuda_codegen():
    import torch

    from mtl.train.compile import inductor_options

    assert inductor_options(tokens_per_call=8192, device=torch.device("cpu")) is None
