"""Ring attention and all-gathered k/v attention at cp=2 and cp=4 (and tp=2 x cp=2) over gloo,
and a ring of one rank, equal full-sequence attention computed in one process.

One ``run_distributed`` call per world size runs every case (the machine has 2 cores), and the
parent compares each rank's gathered output and gradients with a float64 reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import cp_cases by name

import cp_cases
from mtl.parallel.context_parallel.ring_attention import RingAttention
from mtl.parallel.testing import run_distributed

# world size -> (tp, cp[, cp_comm_type]) layouts run in it: the ring, and k/v all-gathered
WORLDS = {2: [(1, 2), (1, 2, "all_gather")], 4: [(1, 4), (2, 2), (1, 4, "all_gather"), (2, 2, "all_gather")]}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"world{w}")
def world(request):
    world_size = request.param
    return WORLDS[world_size], run_distributed(cp_cases.worker, world_size, (WORLDS[world_size],))


@pytest.mark.parametrize("case", cp_cases.CASES, ids=lambda c: c.name)
def test_output_and_gradients_match_full_attention(world, case):
    cp_cases.assert_case_matches_reference(case, *world)


def test_split_gather_positions_and_dropout_refusal(world):
    cp_cases.assert_sharding_and_refusals(*world)


# float64: one whole-sequence block in fp32 is already ~2e-6 off the reference, over the 1e-6
# that the ring's smaller fp32 blocks meet.
@pytest.mark.parametrize("case", [c for c in cp_cases.CASES if c.dtype == torch.float64], ids=lambda c: c.name)
def test_ring_of_one_rank_matches_full_attention(case):
    # The public cp == 1 path is SDPA, so only this reaches a ring of a single step (the diagonal
    # block alone): every output row must be written there, with no later step to merge into.
    inputs = cp_cases.make_inputs(case)
    q, k, v = (inputs[n].clone().requires_grad_() for n in ("q", "k", "v"))
    scale = case.softmax_scale if case.softmax_scale is not None else cp_cases.HEAD_DIM**-0.5
    out = RingAttention.apply(q, k, v, cp_cases.RingOfOne(), case.causal, scale)
    out.backward(inputs["dout"])
    tol = cp_cases.TOLERANCE[case.dtype]
    reference = cp_cases.reference_attention(case, inputs)
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert got.dtype == case.dtype, name
        torch.testing.assert_close(got.detach().double(), reference[name], atol=tol, rtol=tol, msg=name)
