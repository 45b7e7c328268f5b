"""Ring attention at cp=2 and cp=4 (and tp=2 x cp=2) over gloo equals full-sequence attention
computed in one process.

One ``run_distributed`` call per world size runs every case (the machine has 2 cores), and the
parent compares each rank's gathered output and gradients with a float64 reference."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import cp_cases by name

import cp_cases
from mtl.parallel.testing import run_distributed

WORLDS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}  # world size -> (tp, cp) layouts run in it


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"world{w}")
def world(request):
    world_size = request.param
    return WORLDS[world_size], run_distributed(cp_cases.worker, world_size, (WORLDS[world_size],))


@pytest.mark.parametrize("case", cp_cases.CASES, ids=lambda c: c.name)
def test_output_and_gradients_match_full_attention(world, case):
    cp_cases.assert_case_matches_reference(case, *world)


def test_split_gather_positions_and_dropout_refusal(world):
    cp_cases.assert_sharding_and_refusals(*world)
