"""Pipeline schedules on 2 and 4 gloo processes against the single-process model.

One ``run_distributed`` call per world size runs every case of ``pp_cases`` (the machine has
2 cores); each test then checks one case. Every rank's gradients, under global parameter
names, must equal the reference's (each copy is checked: dp replicas and tied copies too).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks import pp_cases by name

import pp_cases  # noqa: E402
import pp_toy  # noqa: E402

from mtl.parallel.testing import run_distributed  # noqa: E402

TOL = 1e-6  # fp32; the pipeline runs the same ops in the same order as the reference


@pytest.fixture(scope="module")
def world_results():
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_distributed(pp_cases.worker, world_size, (world_size,))
        return cache[world_size]

    return get


ALL_CASES = [(world, case) for world, cases in pp_cases.CASES.items() for case in cases]


@pytest.mark.parametrize("world_size,case", ALL_CASES, ids=[c["name"] for _, c in ALL_CASES])
def test_case_matches_single_process(world_results, world_size, case):
    per_rank = [r[case["name"]] for r in world_results(world_size)]
    pp, forward_only = case["pp"], case.get("forward_only", False)
    ref_losses, ref_grads = pp_toy.reference(case["num_layers"], case.get("tied", False), case["micro_batches"])

    # Losses: every last-stage rank reports each micro-batch's loss, in order; others none.
    for result in per_rank:
        if result["pp_rank"] == pp - 1:
            assert result["losses"] == pytest.approx(ref_losses, abs=TOL)
            assert sum(result["losses"]) == pytest.approx(sum(ref_losses), abs=TOL)
        else:
            assert result["losses"] == []

    # Gradients: all parameters are covered, every copy equals the reference.
    seen = set()
    for result in per_rank:
        for name, grad in result["grads"].items():
            seen.add(name)
            if forward_only:
                assert grad is None, f"{case['name']}: forward_only left a gradient on {name}"
            else:
                torch.testing.assert_close(grad, ref_grads[name], atol=TOL, rtol=0, msg=f"{case['name']}: {name}")
    assert seen == set(ref_grads)


NO_SYNC_CASES = [(w, c) for w, c in ALL_CASES if c.get("no_sync")]


@pytest.mark.parametrize("world_size,case", NO_SYNC_CASES, ids=[c["name"] for _, c in NO_SYNC_CASES])
def test_grad_sync_only_in_last_backward(world_results, world_size, case):
    """Each parameter gets one gradient per micro-batch; only the last backward of its chunk
    (per-chunk contexts) or of the rank (one context) runs outside no_sync."""
    num_micro_batches, pp = case["micro_batches"], case["pp"]
    for result in (r[case["name"]] for r in world_results(world_size)):
        for name, events in result["sync_events"].items():
            assert len(events) == num_micro_batches, name
            assert not any(events[:-1]), f"{name}: reduced before the last micro-batch"
            last_chunk_of_rank = case.get("vpp", 1) == 1 or _chunk_of(name, result["pp_rank"], case) == 0
            expect_last = case["no_sync"] == "per_chunk" or last_chunk_of_rank
            assert events[-1] is expect_last, f"{name} on pp rank {result['pp_rank']} of {pp}"


def _chunk_of(name: str, pp_rank: int, case: dict) -> int:
    """Which chunk of ``pp_rank`` holds parameter ``name`` (even split of layers)."""
    pp, vpp, num_layers = case["pp"], case["vpp"], case["num_layers"]
    if name == "embedding":
        return 0
    if name == "head":
        return vpp - 1
    layer = int(name[len("layer") :].split("_")[0])
    virtual_stage = layer // (num_layers // (pp * vpp))
    assert virtual_stage % pp == pp_rank
    return virtual_stage // pp


@pytest.mark.parametrize("name", ["tied_1f1b", "tied_interleaved", "pp2_dp2_1f1b"])
def test_tied_embedding_copies_equal_after_sync(world_results, name):
    world_size = 4 if name.startswith("pp2_dp2") else 2
    per_rank = [r[name] for r in world_results(world_size)]
    copies_after = [g for r in per_rank for n, g in r["grads"].items() if n in ("embedding", "head")]
    assert len(copies_after) == 2 * (world_size // 2)  # a copy on the first and the last stage
    first = next(r for r in per_rank if r["pp_rank"] == 0)["shared_before_sync"]["embedding"]
    last = next(r for r in per_rank if r["pp_rank"] == 1)["shared_before_sync"]["head"]
    # Before the sync each copy holds only its own use (lookup vs. projection) ...
    assert not torch.allclose(first, last, atol=1e-3)
    # ... after it, every copy holds their sum: identical updates keep the weights tied.
    for grad in copies_after:
        torch.testing.assert_close(grad, first + last, atol=TOL, rtol=0)


def test_exchange_both_ways_with_one_peer(world_results):
    """pp = 2: next and previous are the same rank; activation and gradient must not swap."""
    for result in (r["exchange"] for r in world_results(2)):
        peer = 1 - result["pp_rank"]
        assert result["from_prev"] == 10.0 + peer
        assert result["from_next"] == 20.0 + peer
