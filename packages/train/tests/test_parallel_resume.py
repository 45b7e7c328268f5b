"""Save and exact resume at the same parallel layout: each rank writes its own shards, and
4 steps straight equal 2 steps, stop, resume for 2 (fp32, CPU gloo)."""

import pytest

from mtl.core.config_io import load_config
from mtl.parallel.testing import run_distributed
from mtl.train.loop import train
from mtl.train.testing import TINY

BASE = [o for o in TINY if not o.startswith("train.iters")] + ["train.iters=4"]


def straight_then_resumed(overrides: list[str], ckpt: str) -> dict:
    straight = train(load_config(None, [*BASE, *overrides]), progress=False)
    first = train(load_config(None, [*BASE, *overrides, f"ckpt.save='{ckpt}'", "train.exit_interval=2"]), progress=False)
    second = train(load_config(None, [*BASE, *overrides, f"ckpt.load='{ckpt}'"]), progress=False)
    return {"straight": straight.losses, "first": first.losses, "second": second.losses,
            "last_stage": straight.run.topology.is_last_stage}


@pytest.mark.parametrize("world, layout", [
    (2, ["parallel.distributed_optimizer=true"]),  # ZeRO-1: optimizer state sharded over dp
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # norms replicated over TP
    (2, ["parallel.pp=2", "parallel.vpp=2"]),
    (2, ["parallel.cp=2"]),
    (4, ["parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=true"]),  # tied copy on the last stage
], ids=["dp2_distopt", "tp2_sp", "pp2_vpp2", "cp2", "tp2_pp2_tied"])
def test_resume_at_the_same_layout_is_exact(world, layout, tmp_path):
    results = run_distributed(straight_then_resumed, world, args=(layout, str(tmp_path / "ckpt")))
    r = next(r for r in results if r["last_stage"])
    assert sorted(r["first"]) == [1, 2] and sorted(r["second"]) == [3, 4]
    assert {**r["first"], **r["second"]} == r["straight"]
