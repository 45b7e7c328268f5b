"""DataParallel(overlap_param_gather=True) with the distributed optimizer at dp=2.

The optimizer's step only launches the parameter all-gathers; the forward pre-hooks wait for
them bucket by bucket. Three steps of 2 micro-batches (the first in ``no_sync``) must leave
parameters bit-equal (fp32, ``torch.equal``) to the same run with synchronous gathers. The
first forward after a step waits for every bucket, later forwards of the step wait for none,
and ``state_dict()`` / ``finish_param_sync()`` complete the gathers without a forward.
"""

import pytest
import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.ddp import DataParallel
from mtl.parallel.optimizer import build_optimizer
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
TINY_BUCKET_MB = 40 * 4 / 2**20  # 40 fp32 elements: 4 buckets, the first Linear spans two


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def local_micro_batches(step: int, dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    per_rank = x.shape[0] // dp
    xs, ys = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return list(zip(xs.chunk(2), ys.chunk(2)))


def run(overlap: bool, topo: Topology, num_steps: int = 3) -> list[torch.Tensor]:
    model = DataParallel(make_model(), topo, bucket_size_mb=TINY_BUCKET_MB, use_distributed_optimizer=True,
                         overlap_param_gather=overlap)
    opt = build_optimizer(model, topo, use_distributed_optimizer=True, **ADAMW)
    num_buckets = len(model.buckets)
    assert num_buckets == 4
    for step in range(num_steps):
        opt.zero_grad()
        micro = local_micro_batches(step, topo.dp_rank, topo.dp)
        waited_before = model.num_param_gathers_waited_in_forward
        in_flight = num_buckets if (overlap and step > 0) else 0
        if overlap and step == 2:  # reading parameters outside forward: wait for everything first
            model.state_dict()
            assert model.param_gathers_in_flight == 0
            in_flight = 0
        assert model.param_gathers_in_flight == in_flight, (overlap, step)
        with model.no_sync():
            x, y = micro[0]
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        assert model.param_gathers_in_flight == 0
        assert model.num_param_gathers_waited_in_forward == waited_before + in_flight, "first forward waits"
        x, y = micro[1]
        (nn.functional.mse_loss(model(x), y) / 2).backward()
        assert model.num_param_gathers_waited_in_forward == waited_before + in_flight, "later forwards do not"
        model.finish_grad_sync()
        opt.clip_grad_norm(0.05)
        opt.step()
        assert model.param_gathers_in_flight == (num_buckets if overlap else 0)
    model.finish_param_sync()
    model.finish_param_sync()  # idempotent
    assert model.param_gathers_in_flight == 0
    return [p.detach().clone() for p in model.parameters()]


def dp2_overlap_equals_sync():
    topo = Topology.build()
    assert topo.dp == 2
    with_overlap = run(True, topo)
    without = run(False, topo)
    return [torch.equal(a, b) for a, b in zip(with_overlap, without)], with_overlap


def test_dp2_overlap_param_gather_equals_synchronous_gather():
    results = run_distributed(dp2_overlap_equals_sync, world_size=2)
    for rank, (equal, _) in enumerate(results):
        assert all(equal), f"rank {rank}: parameters differ from the synchronous gather: {equal}"
    for a, b in zip(results[0][1], results[1][1]):  # every rank ends with the full parameters
        assert torch.equal(a, b)


def test_overlap_param_gather_needs_distributed_optimizer():
    with pytest.raises(ParallelError, match="overlap_param_gather=True.*use_distributed_optimizer=True"):
        DataParallel(make_model(), Topology.single(), overlap_param_gather=True)


def test_single_process_overlap_is_a_no_op():
    model = DataParallel(make_model(), Topology.single(), use_distributed_optimizer=True, overlap_param_gather=True)
    model.gather_params()
    assert model.param_gathers_in_flight == 0
    model(torch.randn(2, 8))
    assert model.num_param_gathers_waited_in_forward == 0
