"""Ring attention at cp=2 and cp=4 (and tp=2 x cp=2) equals full-sequence attention in one process.

One ``run_distributed`` call per world size runs every case (the machine has 2 cores), and the
parent compares each rank's gathered output and gradients with a float64 reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import cp_cases by name

import cp_cases  # noqa: E402
from mtl.parallel.testing import run_distributed  # noqa: E402

WORLDS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}  # world size -> (tp, cp) layouts run in it
# bfloat16: the result itself is rounded to 8 mantissa bits (relative step 2**-8 ~ 4e-3).
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}

# Hand-written load-balanced layouts for s = 16: rank r holds chunks r and 2cp-1-r.
EXPECTED_POSITIONS = {
    2: [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
    4: [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"world{w}")
def world(request):
    world_size = request.param
    return WORLDS[world_size], run_distributed(cp_cases.worker, world_size, (WORLDS[world_size],))


@pytest.mark.parametrize("case", cp_cases.CASES, ids=lambda c: c.name)
def test_output_and_gradients_match_full_attention(world, case):
    layouts, per_rank = world
    reference = cp_cases.reference_attention(case, cp_cases.make_inputs(case))
    tol = TOLERANCE[case.dtype]
    for layout in layouts:
        for rank, results in enumerate(per_rank):
            got = results[layout]["cases"][case.name]
            for name, expected in reference.items():
                assert got[name].dtype == case.dtype, (layout, rank, name)
                torch.testing.assert_close(
                    got[name].double(), expected, atol=tol, rtol=tol,
                    msg=lambda m: f"(tp, cp) = {layout}, rank {rank}, {name}: {m}",
                )


def test_split_gather_round_trip_and_positions(world):
    layouts, per_rank = world
    full = torch.arange(2 * 3 * cp_cases.SEQ, dtype=torch.float32).reshape(2, cp_cases.SEQ, 3)
    for tp, cp in layouts:
        for results in per_rank:
            layout = results[(tp, cp)]
            assert layout["local_shape"] == (2, cp_cases.SEQ // cp, 3)
            assert torch.equal(layout["round_trip"], full)
            assert layout["position_ids"].tolist() == EXPECTED_POSITIONS[cp][layout["cp_rank"]]


def test_dropout_refused_with_context_parallelism(world):
    layouts, per_rank = world
    for layout in layouts:
        for results in per_rank:
            message = results[layout]["dropout_error"]
            assert message is not None and "model.attention_dropout = 0" in message
