"""Every parallel layout trains like one process: same losses for 3 steps, same gradients
(gathered to full shape) at the last step. fp32 on CPU with gloo; tolerances are in
``mtl.train.testing`` (the GPU check, tests/gpu/test_equivalence_nccl.py, uses the same)."""

import pytest

from mtl.parallel.testing import run_distributed
from mtl.core.config_io import load_config
from mtl.train.testing import LAYOUTS, TINY, compare_with_reference, run_layouts, run_tiny


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(run_tiny, 1, args=([],))
    return result


@pytest.fixture(scope="module")
def layouts():
    """Every layout's results, those of one world size from one spawn (2 spawns, not 14)."""
    return run_layouts(list(LAYOUTS))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, layouts):
    assert reference["losses"] and reference["grads"]
    compare_with_reference(layout, layouts[layout], reference)


def test_the_flops_layout_is_uneven():
    """``pp2_flops`` proves something only if its split is not the even one."""
    world, overrides = LAYOUTS["pp2_flops"]
    cfg = load_config(None, [*TINY, *overrides]).resolve(world_size=world, tokenizer_vocab_size=257)
    assert cfg.parallel.virtual_stage_layers == [3, 1]


def test_pipeline_under_bf16_matches_single_process():
    """Under bf16 autocast the stages exchange the fp32 residual stream; pp=2 must train like
    one process (the bf16 matmuls are the same ones, so the losses agree closely)."""
    bf16 = ["train.precision='bf16'"]
    (single,) = run_distributed(run_tiny, 1, args=(bf16, False))
    piped = run_distributed(run_tiny, 2, args=([*bf16, "parallel.pp=2"], False))
    losses = next(r["losses"] for r in piped if r["last_stage"])
    assert losses.keys() == single["losses"].keys()
    for step, loss in single["losses"].items():
        assert abs(losses[step] - loss) < 1e-3 * abs(loss), (step, losses[step], loss)


def test_unevenly_split_interleaved_pipeline_matches_single_process():
    """``parallel.virtual_stage_layers`` (how the reference model's pp=2 stages are balanced
    against the LM head): 6 layers as 2, 2, 1, 1 over pp=2, vpp=2 train like one process."""
    six = ["model.num_layers=6"]
    (single,) = run_distributed(run_tiny, 1, args=(six,))
    split = run_distributed(run_tiny, 2, args=([*six, "parallel.pp=2", "parallel.vpp=2",
                                                "parallel.virtual_stage_layers=[2, 2, 1, 1]"],))
    compare_with_reference("pp2_vpp2 split 2, 2, 1, 1", split, single)
    held = [sorted({int(name.split(".")[1]) for name in r["grads"] if name.startswith("layers.")}) for r in split]
    assert held == [[0, 1, 4], [2, 3, 5]], held
