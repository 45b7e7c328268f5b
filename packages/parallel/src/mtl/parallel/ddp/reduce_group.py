"""Which ranks a parameter's gradient is reduced over, and by what it is scaled.

Dense parameters are replicated over data x context parallel: their gradients are averaged
over ``dp_cp``. Expert parameters (``param.expert_split_dim`` set: each expert-parallel rank
holds different experts) are replicated only over the ranks holding the same experts,
``edp_cp`` (dp/ep x cp ranks). Their local gradient already sums what every rank of the ep
group sent to them (the token all-to-all's backward brings those contributions home), so the
gradient of the global mean loss is that sum over ``edp_cp`` divided by the *whole* dp x cp
size, the same divisor as dense gradients: with ep = dp each expert's gradient is then
scaled without any collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

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

    @classmethod
    def of(cls, topology: Topology, name: str) -> "ReduceGroup":
        group = topology.group(name)
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        src = topology.group_ranks[name][0] if group is not None else topology.rank
        return cls(name, group, size, rank, src, topology.dp * topology.cp)
