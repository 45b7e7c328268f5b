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
    with pytest.raises(ParallelError, match="tp\\*pp\\*cp\\*ep = 2 needs that many processes"):
        Topology.build(tp=2)
    with pytest.raises(ParallelError, match="tp\\*pp\\*cp\\*ep = 2 needs that many processes"):
        Topology.build(ep=2)


EP_LAYOUTS = [(1, 1, 2, 1, 2), (2, 1, 4, 1, 2), (1, 2, 4, 2, 2), (2, 1, 4, 2, 4), (1, 1, 6, 1, 3)]


@pytest.mark.parametrize("tp,cp,dp,pp,ep", EP_LAYOUTS)
def test_expert_groups_carve_ep_from_data_parallel(tp, cp, dp, pp, ep):
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    sets = topo._expert_rank_sets()
    for name, size in (("ep", ep), ("edp", dp // ep), ("edp_cp", cp * dp // ep)):
        groups = [ranks for n, ranks in sets if n == name]
        assert sorted(itertools.chain(*groups)) == list(range(topo.world_size))  # a partition
        assert all(len(ranks) == size for ranks in groups), (name, groups)
        for ranks in groups:
            coords = [Topology(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, rank=r) for r in ranks]
            # every expert group lies inside one (tp, pp) position
            assert len({(c.tp_rank, c.pp_rank) for c in coords}) == 1
            if name == "ep":  # consecutive dp ranks, one cp position, every ep_rank once
                assert sorted(c.ep_rank for c in coords) == list(range(ep))
                assert len({c.cp_rank for c in coords}) == 1
                assert [c.dp_rank for c in coords] == list(range(coords[0].dp_rank, coords[0].dp_rank + ep))
            else:  # the same experts everywhere; edp keeps cp fixed, edp_cp varies it
                assert len({c.ep_rank for c in coords}) == 1
                assert sorted({c.expert_dp_rank for c in coords}) == list(range(dp // ep))
                assert len({c.cp_rank for c in coords}) == (1 if name == "edp" else cp)
    # ep x edp_cp is the dp x cp group: every dense-replica rank is in exactly one of each
    for rank in range(topo.world_size):
        me = Topology(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, rank=rank)
        assert me.ep_rank + ep * me.expert_dp_rank == me.dp_rank


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
        # ep = 1: the expert groups are the dense groups themselves (no second communicator)
        assert topo.group("edp") is topo.group("dp") and topo.group("edp_cp") is topo.group("dp_cp")
        assert topo.group_ranks["edp_cp"] == topo.group_ranks["dp_cp"]
        out[str(layout)] = (topo.tp_rank, topo.cp_rank, topo.dp_rank, topo.pp_rank)
    for layout in ({"ep": 2}, {"cp": 2, "ep": 2}):
        topo = Topology.build(**layout)
        sums = {}
        for name in ("ep", "edp", "edp_cp"):
            group = topo.group(name)
            total = torch.tensor([float(rank)])
            if group is not None:
                dist.all_reduce(total, group=group)
            sums[name] = int(total.item())
        out[str(layout)] = (topo.ep_rank, topo.expert_dp_rank, topo.expert_dp, sums)
    return out


def test_groups_on_four_processes_match_the_arithmetic():
    results = run_distributed(groups_on_four_ranks, world_size=4)
    assert [r["{'tp': 2, 'pp': 2}"] for r in results] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 1)]
    assert [r["{'tp': 2, 'cp': 2}"] for r in results] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0)]
    assert [r["{'pp': 2}"] for r in results] == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 1, 1)]
    # dp=4, ep=2: ep groups {0,1} {2,3}; ranks holding the same experts {0,2} {1,3}
    assert [r["{'ep': 2}"] for r in results] == [
        (0, 0, 2, {"ep": 1, "edp": 2, "edp_cp": 2}), (1, 0, 2, {"ep": 1, "edp": 4, "edp_cp": 4}),
        (0, 1, 2, {"ep": 5, "edp": 2, "edp_cp": 2}), (1, 1, 2, {"ep": 5, "edp": 4, "edp_cp": 4})]
    # cp=2, dp=2, ep=2 (rank = cp + 2 dp): ep {0,2} {1,3}; edp alone; edp_cp {0,1} {2,3}
    assert [r["{'cp': 2, 'ep': 2}"] for r in results] == [
        (0, 0, 1, {"ep": 2, "edp": 0, "edp_cp": 1}), (0, 0, 1, {"ep": 4, "edp": 1, "edp_cp": 1}),
        (1, 0, 1, {"ep": 2, "edp": 2, "edp_cp": 5}), (1, 0, 1, {"ep": 4, "edp": 3, "edp_cp": 5})]
