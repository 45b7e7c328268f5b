"""DataParallel at dp=2 gives the single-process gradient of the whole batch.

Each rank runs 2 micro-batches (the first inside ``no_sync``) of its half of a global batch
of 8; after ``finish_grad_sync`` every gradient (with the distributed optimizer: this rank's
owned shard of it) must equal the gradient of one process on all 8 samples within 1e-6.
Buckets are made tiny so the model spans several of them. A parameter flagged
``shared_embedding`` must get its whole averaged gradient even with the distributed optimizer.
"""

import pytest
import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.ddp import DataParallel
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.parallel.param_layout import param_layout, set_param_layout

TOL = dict(rtol=1e-6, atol=1e-6)
TINY_BUCKET_MB = 60 * 4 / 2**20  # 60 fp32 elements: the MLP below spans 3 buckets


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def reference_grads(step: int) -> list[torch.Tensor]:
    model = make_mlp()
    x, y = make_batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def local_micro_batches(step: int, dp_rank: int, dp: int, num_micro: int = 2):
    x, y = make_batch(step)
    per_rank = x.shape[0] // dp
    xs, ys = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return list(zip(xs.chunk(num_micro), ys.chunk(num_micro)))


def dp2_gradients_match():
    topo = Topology.build()
    assert topo.dp == 2
    for overlap in (True, False):
        for dist_opt in (False, True):
            label = f"overlap={overlap} distributed_optimizer={dist_opt}"
            module = make_mlp()
            if dist_opt:  # a tied embedding's bucket must come back whole for the pipeline's sum
                set_param_layout(module[0].weight, shared_embedding=True)
            if topo.dp_rank == 1:  # construction must broadcast rank 0's parameters
                with torch.no_grad():
                    for p in module.parameters():
                        p.add_(1.0)
            model = DataParallel(module, topo, bucket_size_mb=TINY_BUCKET_MB, overlap_grad_reduce=overlap,
                                 use_distributed_optimizer=dist_opt)
            assert len(model.buckets) == 3, label
            for p, p_ref in zip(model.parameters(), make_mlp().parameters()):
                torch.testing.assert_close(p, p_ref, rtol=0, atol=0, msg=label)
            for step in range(2):  # the second step proves zero_grad() resets buffers and buckets
                model.zero_grad()
                micro = local_micro_batches(step, topo.dp_rank, topo.dp)
                with model.no_sync():
                    x, y = micro[0]
                    (nn.functional.mse_loss(model(x), y) / len(micro)).backward()
                assert model.num_collectives_launched == 0, f"{label}: no_sync must not communicate"
                x, y = micro[1]
                (nn.functional.mse_loss(model(x), y) / len(micro)).backward()
                expected = len(model.buckets) if overlap else 0
                assert model.num_collectives_launched == expected, f"{label}: launched during backward"
                model.finish_grad_sync()
                model.finish_grad_sync()  # idempotent: a second call must not reduce again
                assert model.num_collectives_launched == len(model.buckets), label
                for p, g_ref in zip(model.parameters(), reference_grads(step)):
                    if dist_opt and not param_layout(p).shared_embedding:
                        first, last = p.dp_owned_grad_range
                        torch.testing.assert_close(p.grad.view(-1)[first:last], g_ref.view(-1)[first:last],
                                                   **TOL, msg=label)
                    else:
                        torch.testing.assert_close(p.grad, g_ref, **TOL, msg=label)
            if dist_opt:  # the owned ranges of both ranks tile every parameter exactly once
                return_ranges = [p.dp_owned_grad_range for p in model.parameters()]
    return return_ranges


def test_dp2_gradients_equal_full_batch_gradient():
    ranges_per_rank = run_distributed(dp2_gradients_match, world_size=2)
    for param_index, p in enumerate(make_mlp().parameters()):
        covered = sorted(r[param_index] for r in ranges_per_rank)
        owned = sum(last - first for first, last in covered)
        assert owned == p.numel(), (param_index, covered)


def test_single_process_layout_and_views():
    module = make_mlp()
    model = DataParallel(module, Topology.single(), bucket_size_mb=TINY_BUCKET_MB)
    buf = model.buffers_by_dtype[0]
    # Reverse parameter order: the last layer's bias is first in the buffer.
    assert buf.slots[0].param is list(module.parameters())[-1]
    assert buf.numel == sum(p.numel() for p in module.parameters())
    for p in module.parameters():
        assert buf.grad_is_attached(buf.slot_of[id(p)])
    x, y = make_batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    model.finish_grad_sync()
    for p, g_ref in zip(module.parameters(), reference_grads(0)):
        torch.testing.assert_close(p.grad, g_ref, **TOL)
    model.zero_grad()
    assert buf.grad_data.abs().sum() == 0
    module.zero_grad()  # sets param.grad to None: the next backward must refuse loudly
    with pytest.raises(ParallelError, match="DataParallel.zero_grad"):
        nn.functional.mse_loss(model(x), y).backward()


def test_bad_bucket_size_is_refused():
    with pytest.raises(ParallelError, match="bucket_size_mb"):
        DataParallel(make_mlp(), Topology.single(), bucket_size_mb=0)
