"""Sharded data parallelism (``parallel.sharding``, ``dp_replicate``) trains like one process:
fp32 on CPU with gloo, the first 3 losses within 1e-5 relative and the gradients, gathered to
their full shape from the ranks' shards, within ``mtl.train.testing``'s tolerances.

- dp=2, ZeRO-3 (parameters gathered per layer, freed, gathered again for backward); its
  checkpoint resumes under ZeRO-2 (gradients reduce-scattered per bucket, shards kept) for
  steps 4-6, whose losses and step-6 gradients equal a straight 6-step run of one process.
- ep=2 with a mixture of experts under ZeRO-3 (experts sharded over their replicas).

dp=4 as 2 replicas x 2 shards (hybrid) is checked in mtl-cli's ``test_sharding_dp4.py``, in the
4-process spawn that measures memory. The other layouts of ``SHARDED_LAYOUTS`` (dp4, tp2 x dp2,
dp2 x pp2 under ZeRO-3) run the same code paths; ``run_layout`` runs any of them (each
4-process run costs ~50 s on two shared cores). One spawn per world size: the single process
runs the references, two processes run the rest.
"""

import pytest

from mtl.parallel.testing import run_distributed
from mtl.train.testing import MOE_TINY, compare_with_reference, run_tiny

SCHEDULE = ["train.lr_decay_iters=6"]  # a 3-step run is the first half of the 6-step one


def single_process_runs() -> dict:
    return {"reference": run_tiny(SCHEDULE), "straight": run_tiny([*SCHEDULE, "train.iters=6"]),
            "moe": run_tiny(MOE_TINY)}


def two_process_runs(save_dir: str) -> dict:
    return {
        "zero3": run_tiny([*SCHEDULE, "parallel.sharding='parameters'", f"ckpt.save='{save_dir}'"]),
        "zero2_resumed": run_tiny([*SCHEDULE, "parallel.sharding='gradients'", "train.iters=6",
                                   f"ckpt.load='{save_dir}'"]),
        "moe_ep2_zero3": run_tiny([*MOE_TINY, "parallel.ep=2", "parallel.sharding='parameters'"]),
    }


@pytest.fixture(scope="module")
def single():
    (result,) = run_distributed(single_process_runs, 1)
    return result


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_distributed(two_process_runs, 2, args=(str(tmp_path_factory.mktemp("zero3")),))


def test_dp2_zero3_matches_single_process(two, single):
    compare_with_reference("dp2 zero3", [r["zero3"] for r in two], single["reference"])


def test_zero3_checkpoint_resumes_under_zero2_like_a_straight_run(two, single):
    resumed = [r["zero2_resumed"] for r in two]
    assert sorted(resumed[0]["losses"]) == [4, 5, 6]
    straight = {**single["straight"], "losses": {s: single["straight"]["losses"][s] for s in (4, 5, 6)}}
    compare_with_reference("zero3 -> zero2 resume", resumed, straight)


def test_ep2_moe_zero3_matches_single_process(two, single):
    compare_with_reference("ep2 moe zero3", [r["moe_ep2_zero3"] for r in two], single["moe"])
