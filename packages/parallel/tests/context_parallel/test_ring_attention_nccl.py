"""The same equivalence as ``test_ring_attention.py`` on GPUs over NCCL (one process per GPU,
cp=2, both ``cp_comm_type`` values). Skipped on machines with fewer than two CUDA devices, such as CI."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

import cp_cases
from mtl.parallel.testing import free_port

LAYOUTS = [(1, 2), (1, 2, "all_gather")]  # the ring, and k/v all-gathered
WORLD_SIZE = 2

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} CUDA devices for NCCL"
)


@pytest.fixture(scope="module")
def per_rank():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            cp_cases.nccl_rank,
            args=(WORLD_SIZE, free_port(), out_dir, LAYOUTS),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", cp_cases.CASES, ids=lambda c: c.name)
def test_output_and_gradients_match_full_attention_nccl(per_rank, case):
    cp_cases.assert_case_matches_reference(case, LAYOUTS, per_rank)


def test_split_gather_positions_and_dropout_refusal_nccl(per_rank):
    cp_cases.assert_sharding_and_refusals(LAYOUTS, per_rank)
