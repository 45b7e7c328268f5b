"""parallel.overlap_param_gather: the distributed optimizer's all-gathers overlap the next
forward and nothing else changes. fp32 on CPU with gloo:

- dp=2: same losses as one process for 3 steps, and bit-equal losses and final parameters
  to the same run with synchronous gathers;
- pp=2 x vpp=2 x dp=2 (world 4): same losses as one process (two chunks per rank, each
  running several micro-batch forwards per step: only the first waits);
- dp=2: saving after step 2 (which must wait for the in-flight gathers) and resuming gives
  exactly the losses of 4 straight steps.
"""

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import TINY, compare_with_reference, run_tiny

DISTOPT = ["parallel.distributed_optimizer=true"]
OVERLAP = [*DISTOPT, "parallel.overlap_param_gather=true"]


def _params(result) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in result.run.chunks for p in chunk.parameters()]


def overlap_and_sync(overrides: list[str]) -> dict:
    overlapped = train(load_config(None, [*TINY, *overrides, *OVERLAP]), progress=False)
    chunks = overlapped.run.chunks
    assert all(c.overlap_param_gather for c in chunks)
    assert all(c.param_gathers_in_flight == 0 for c in chunks), "train() must hand back complete parameters"
    assert sum(c.num_param_gathers_waited_in_forward for c in chunks) > 0, "the forward hooks never waited"
    synchronous = train(load_config(None, [*TINY, *overrides, *DISTOPT]), progress=False)
    return {
        "losses": overlapped.losses,
        "sync_losses": synchronous.losses,
        "params_equal": all(torch.equal(a, b) for a, b in zip(_params(overlapped), _params(synchronous), strict=True)),
        "last_stage": overlapped.run.topology.is_last_stage,
    }


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(run_tiny, 1, args=([], False))
    return result


def test_dp2_overlap_matches_one_process_and_synchronous_gather(reference):
    results = run_distributed(overlap_and_sync, 2, args=([],))
    compare_with_reference("dp2_distopt_overlap", results, reference)
    for rank, r in enumerate(results):
        assert r["losses"] == r["sync_losses"], f"rank {rank}: {r['losses']} vs {r['sync_losses']}"
        assert r["params_equal"], f"rank {rank}: final parameters differ from synchronous gathers"


def test_pp2_vpp2_dp2_overlap_matches_one_process(reference):
    results = run_distributed(run_tiny, 4, args=(["parallel.pp=2", "parallel.vpp=2", *OVERLAP], False))
    compare_with_reference("pp2_vpp2_dp2_distopt_overlap", results, reference)


BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=4", *OVERLAP]


def straight_then_resumed(ckpt: str) -> dict:
    straight = train(load_config(None, BASE), progress=False)
    first = train(load_config(None, [*BASE, f"ckpt.save='{ckpt}'", "train.exit_interval=2"]), progress=False)
    second = train(load_config(None, [*BASE, f"ckpt.load='{ckpt}'"]), progress=False)
    return {"straight": straight.losses, "first": first.losses, "second": second.losses,
            "last_stage": straight.run.topology.is_last_stage}


def test_dp2_overlap_save_and_resume_is_exact(tmp_path):
    results = run_distributed(straight_then_resumed, 2, args=(str(tmp_path / "ckpt"),))
    r = next(r for r in results if r["last_stage"])
    assert sorted(r["first"]) == [1, 2] and sorted(r["second"]) == [3, 4]
    assert {**r["first"], **r["second"]} == r["straight"]
