"""The flat all-gather and reduce-scatter under this torch's name: right results, and no
FutureWarning from torch's renamed functions (torch 2.13 warns on every call of the old names,
which tp/sp, the distributed optimizer and the data-parallel reduce made in every run)."""

import warnings

import torch
import torch.distributed as dist

from mtl.parallel.flat_collectives import all_gather_flat, reduce_scatter_flat
from mtl.parallel.tensor_parallel.collectives import all_gather_along_dim
from mtl.parallel.testing import run_distributed


def test_the_current_names_where_torch_has_them():
    assert all_gather_flat is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert reduce_scatter_flat is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _gather_and_scatter() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        local = torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * rank
        along_dim = all_gather_along_dim(local, 1, dist.group.WORLD)  # the tp/sp path
        flat = torch.empty(6 * world)
        all_gather_flat(flat, local.flatten(), group=dist.group.WORLD)  # ZeRO-1's parameter gather
        shard = torch.empty(4)
        reduce_scatter_flat(shard, torch.arange(4.0 * world) * (rank + 1), group=dist.group.WORLD)
    return {"along_dim": along_dim, "flat": flat, "shard": shard}


def test_two_ranks_gather_and_scatter_without_warnings():
    results = run_distributed(_gather_and_scatter, 2)
    local = [torch.arange(6, dtype=torch.float32).view(3, 2) + 10 * r for r in range(2)]
    summed = torch.arange(8.0) * 3  # ranks contribute x1 and x2
    for rank, result in enumerate(results):
        assert torch.equal(result["along_dim"], torch.cat(local, dim=1))
        assert torch.equal(result["flat"], torch.cat([t.flatten() for t in local]))
        assert torch.equal(result["shard"], summed[4 * rank: 4 * rank + 4])
