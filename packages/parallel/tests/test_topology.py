"""Topology rank arithmetic for (tp, cp, dp, pp) layouts, and real groups on 4 processes."""

import itertools

import pytest
import torch
import torch.distributed as dist

from mtl.core.errors import ParallelError
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1), (1, 1, 2, 2), (2, 1, 2, 2), (2, 2, 2, 2), (4, 1, 2, 1), (1, 3, 1, 2)]


@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_coordinates_invert_rank_of_with_tp_fastest(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    seen = set()
    for rank in range(world):
        topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp, rank=rank)
        c = (topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.pp_rank)
        assert topo.rank_of(*c) == rank
        assert rank == c[0] + tp * (c[1] + cp * (c[2] + dp * c[3]))
        assert topo.is_first_stage == (c[3] == 0) and topo.is_last_stage == (c[3] == pp - 1)
        assert topo.pp_peer(1) == topo.rank_of(c[0], c[1], c[2], (c[3] + 1) % pp)
        assert topo.pp_peer(-1) == topo.rank_of(c[0], c[1], c[2], (c[3] - 1) % pp)
        seen.add(c)
    assert len(seen) == world


@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_rank_sets_partition_the_world_and_vary_only_their_axes(tp, cp, dp, pp):
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp)
    world = topo.world_size
    for varying in [("tp",), ("cp",), ("dp",), ("pp",), ("cp", "dp"), ("tp", "pp")]:
        sets = topo._rank_sets(varying)
        assert sorted(itertools.chain(*sets)) == list(range(world))  # a partition
        size = 1
        for axis in varying:
            size *= getattr(topo, axis)
        assert all(len(s) == size for s in sets)
        for ranks in sets:
            coords = [Topology(tp=tp, cp=cp, dp=dp, pp=pp, rank=r) for r in ranks]
            for axis in ("tp", "cp", "dp", "pp"):
                values = {c.coord(axis) for c in coords}
                assert len(values) == (getattr(topo, axis) if axis in varying else 1)
    if tp > 1:  # a TP group is a block of consecutive ranks (stays inside a node)
        assert all(s == list(range(s[0], s[0] + tp)) for s in topo._rank_sets(("tp",)))


def test_single_and_build_without_process_group():
    assert Topology.single().world_size == 1 and Topology.single().tp_group is None
    assert Topology.build().world_size == 1
    with pytest.raises(ParallelError, match="tp\\*pp\\*cp = 2 needs that many processes"):
        Topology.build(tp=2)


def groups_on_four_ranks():
    rank = dist.get_rank()
    out = {}
    for layout in ({"tp": 2, "pp": 2}, {"tp": 2, "cp": 2}, {"pp": 2}):
        topo = Topology.build(**layout)
        expected = Topology(tp=topo.tp, cp=topo.cp, dp=topo.dp, pp=topo.pp, rank=rank)
        for name in ("tp", "cp", "dp", "pp"):
            varying = expected._rank_sets((name,))
            mine = next(s for s in varying if rank in s)
            group = topo.group(name)
            if len(mine) == 1:
                assert group is None
                continue
            assert topo.group_ranks[name] == mine
            # the group really connects those ranks: the sum of global ranks comes back
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            assert total.item() == sum(mine), (layout, name, total, mine)
        embedding = topo.group_ranks["embedding"]
        assert embedding == sorted({topo.rank_of(topo.tp_rank, topo.cp_rank, topo.dp_rank, p) for p in (0, topo.pp - 1)})
        out[str(layout)] = (topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.pp_rank)
    return out


def test_groups_on_four_processes_match_the_arithmetic():
    results = run_distributed(groups_on_four_ranks, world_size=4)
    assert [r["{'tp': 2, 'pp': 2}"] for r in results] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 1)]
    assert [r["{'tp': 2, 'cp': 2}"] for r in results] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0)]
    assert [r["{'pp': 2}"] for r in results] == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 1, 1)]
