"""Which ranks a parameter's gradient is reduced over, and by what it is scaled.

Dense parameters are replicated over data x context parallel: their gradients are averaged
over ``dp_cp``. Expert parameters (``param.expert_split_dim`` set: each expert-parallel rank
holds different experts) are replicated only over the ranks holding the same experts,
``edp_cp`` (dp/ep x cp ranks). Their local gradient already sums what every rank of the ep
group sent to them (the token all-to-all's backward brings those contributions home), so the
gradient of the global mean loss is that sum over ``edp_cp`` divided by the *whole* dp x cp
size, the same divisor as dense gradients: with ep = dp each expert's gradient is then
scaled without any collective.

Hybrid sharding (``dp_replicate`` = R > 1, HSDP): the group's ranks, in order, are cut into R
blocks of consecutive ranks; each block shards the state (``group``, ``size``, ``rank`` are the
block's) and the ranks with the same index in every block form ``replicate_group``, over which
the reduced gradient shards are summed once per step. ``whole_group`` stays the unsplit group:
parameters are broadcast over it at the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.param_layout import param_layout
from mtl.parallel.topology import Topology

DENSE, EXPERT = "dp_cp", "edp_cp"


def is_expert_param(param: nn.Parameter) -> bool:
    return param_layout(param).expert_split_dim is not None


@dataclass(frozen=True)
class ReduceGroup:
    name: str  # DENSE or EXPERT: the topology's group
    group: object | None  # None: this rank alone
    size: int
    rank: int  # this rank's index in the group (its shard under the distributed optimizer)
    src: int  # the global rank whose initial parameters every member starts from
    grad_divisor: int  # gradients are divided by it before the SUM collective
    replicate_group: object | None = None  # hybrid sharding: the same shard in the other blocks
    whole_group: object | None = None  # the group before hybrid sharding split it

    @classmethod
    def of(cls, topology: Topology, name: str, dp_replicate: int = 1) -> "ReduceGroup":
        group = topology.group(name)
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        src = topology.group_ranks[name][0] if group is not None else topology.rank
        divisor = topology.dp * topology.cp
        if dp_replicate == 1:
            return cls(name, group, size, rank, src, divisor, whole_group=group)
        shard_group, replicate_group = hybrid_groups(topology, name, dp_replicate)
        return cls(name, shard_group, size // dp_replicate, rank % (size // dp_replicate), src, divisor,
                   replicate_group, group)


def hybrid_groups(topology: Topology, name: str, dp_replicate: int) -> tuple[object, object]:
    """(shard block, replicate group) of this rank inside topology group ``name`` (``dp_cp`` or
    its expert twin at ep = 1), created once per topology: ``new_group`` is collective, so every
    rank creates every block of every such group, in one order."""
    cache = topology.__dict__.setdefault("_hybrid_groups", {})
    key = dp_replicate  # dense and expert groups (ep = 1) have the same ranks
    if key not in cache:
        if name == "edp_cp" and topology.ep > 1:
            raise ParallelError(f"hybrid sharding (dp_replicate = {dp_replicate}) needs ep = 1, got ep = {topology.ep}")
        ranks_of_group = topology._rank_sets(("cp", "dp"))  # edp_cp equals dp_cp at ep = 1
        size = len(ranks_of_group[0])
        if size % dp_replicate or size == dp_replicate:
            raise ParallelError(f"dp_replicate = {dp_replicate} must divide the {size} ranks of '{name}' "
                                "and leave blocks of at least 2 (parallel.dp_replicate)")
        block = size // dp_replicate
        mine: list[object] = [None, None]
        for ranks in ranks_of_group:
            for start in range(0, size, block):  # the shard blocks
                members = ranks[start:start + block]
                created = dist.new_group(members)
                if topology.rank in members:
                    mine[0] = created
            for index in range(block):  # the replicas of each shard
                members = ranks[index::block]
                created = dist.new_group(members)
                if topology.rank in members:
                    mine[1] = created
        cache[key] = tuple(mine)
    return cache[key]
