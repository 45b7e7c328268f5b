"""One object that knows every process group and every rank's coordinates.

Ranks are ordered tp-fastest, then cp, then dp, then pp (as Megatron orders them), so a
TP group is a block of consecutive ranks and stays inside a node:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Every rank creates every group in the same order (``new_group`` is collective).

Expert parallelism is carved from the data-parallel ranks (as Megatron does): each dp group
is cut into blocks of ``ep`` consecutive dp ranks (the "ep" group: each member holds a
different ``num_experts / ep`` of the experts and they exchange tokens), and the dp ranks
holding the same experts form the expert-data-parallel group ("edp", ``dp / ep`` ranks):

    ep_rank = dp_rank % ep          expert_dp_rank = dp_rank // ep

"edp_cp" adds the context-parallel ranks, as "dp_cp" does for dense parameters: expert
gradients are reduced over it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from mtl.core.errors import ParallelError

AXES = ("tp", "cp", "dp", "pp")  # fastest first
# At ep = 1 every rank holds every expert: the expert groups are these dense ones.
EXPERT_ALIASES = {"edp": "dp", "edp_cp": "dp_cp"}


def _expert_aliases(ep: int, cp: int) -> dict[str, str]:
    """Expert groups whose ranks equal another group's (which they reuse rather than create a
    second NCCL communicator over the same ranks): the dense ones at ep = 1; without context
    parallelism "edp" is "edp_cp"."""
    if ep == 1:
        return EXPERT_ALIASES
    return {"edp": "edp_cp"} if cp == 1 else {}


@dataclass
class Topology:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    rank: int = 0
    # how cp ranks share keys/values: "p2p" (ring attention) or "all_gather" (mtl.parallel.context_parallel)
    cp_comm_type: str = "p2p"
    groups: dict[str, object] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def single(cls) -> "Topology":
        """The topology of one process with no process group."""
        return cls()

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int = 1, ep: int = 1,
              cp_comm_type: str = "p2p") -> "Topology":
        """Create all groups over the initialised default process group (or none if one process)."""
        if not dist.is_available() or not dist.is_initialized():
            if tp * pp * cp * ep != 1:
                raise ParallelError(
                    f"tp*pp*cp*ep = {tp * pp * cp * ep} needs that many processes; launch with torchrun"
                )
            return cls(vpp=vpp, cp_comm_type=cp_comm_type)
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise ParallelError(
                f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}"
            )
        dp = world // (tp * pp * cp)
        if dp % ep:
            raise ParallelError(f"ep = {ep} must divide the data-parallel size {dp}")
        topo = cls(tp=tp, cp=cp, dp=dp, pp=pp, vpp=vpp, ep=ep, rank=dist.get_rank(), cp_comm_type=cp_comm_type)
        topo._create_groups(world)
        return topo

    def _create_groups(self, world: int) -> None:
        # Each named group varies the listed axes and fixes the others.
        layouts = {
            "tp": ("tp",),
            "cp": ("cp",),
            "dp": ("dp",),
            "pp": ("pp",),
            "dp_cp": ("cp", "dp"),  # gradients are averaged over data *and* context shards
            "tp_pp": ("tp", "pp"),  # the model-parallel group: parameters are split over it
            "tp_cp": ("tp", "cp"),
        }
        for name, varying in layouts.items():
            for ranks in self._rank_sets(varying):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[name] = group
                    self.group_ranks[name] = ranks
        aliases = _expert_aliases(self.ep, self.cp)
        for name, ranks in self._expert_rank_sets():
            if name in aliases:  # the same ranks as another group: reuse it
                continue
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.groups[name] = group
                self.group_ranks[name] = ranks
        for name, same in aliases.items():
            self.groups[name], self.group_ranks[name] = self.groups[same], self.group_ranks[same]
        # Embedding group: first and last pipeline stage, to keep tied weights in sync.
        for pp_ranks in self._rank_sets(("pp",)):
            ranks = sorted({pp_ranks[0], pp_ranks[-1]})
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.groups["embedding"] = group
                self.group_ranks["embedding"] = ranks
        assert world == self.tp * self.cp * self.dp * self.pp

    def _rank_sets(self, varying: tuple[str, ...]) -> list[list[int]]:
        sizes = {a: getattr(self, a) for a in AXES}
        fixed = [a for a in AXES if a not in varying]
        sets = []
        for fixed_coords in itertools.product(*(range(sizes[a]) for a in fixed)):
            coords = dict(zip(fixed, fixed_coords))
            ranks = []
            for var_coords in itertools.product(*(range(sizes[a]) for a in reversed(varying))):
                coords.update(zip(reversed(varying), var_coords))
                ranks.append(self.rank_of(**coords))
            sets.append(sorted(ranks))
        return sets

    def _expert_rank_sets(self) -> list[tuple[str, list[int]]]:
        """("ep" | "edp" | "edp_cp", ranks) for every expert group, in one order for all ranks."""
        sets = []
        for dp_ranks in self._rank_sets(("dp",)):  # sorted: index i holds dp_rank i
            # ep: consecutive blocks of ep ranks inside each dp group
            for start in range(0, self.dp, self.ep):
                sets.append(("ep", dp_ranks[start : start + self.ep]))
            # edp: the dp ranks with the same ep_rank (the same experts)
            for ep_rank in range(self.ep):
                sets.append(("edp", dp_ranks[ep_rank :: self.ep]))
        for dp_cp_ranks in self._rank_sets(("cp", "dp")):
            for ep_rank in range(self.ep):
                ranks = [r for r in dp_cp_ranks if self._coord_of(r, "dp") % self.ep == ep_rank]
                sets.append(("edp_cp", ranks))
        return sets

    # ---- coordinates --------------------------------------------------------------------
    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coord(self, axis: str) -> int:
        return self._coord_of(self.rank, axis)

    def _coord_of(self, rank: int, axis: str) -> int:
        stride = 1
        for a in AXES:
            if a == axis:
                return (rank // stride) % getattr(self, a)
            stride *= getattr(self, a)
        raise KeyError(axis)

    @property
    def tp_rank(self) -> int:
        return self.coord("tp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def ep_rank(self) -> int:
        """Which block of ``num_experts / ep`` experts this rank holds."""
        return self.dp_rank % self.ep

    @property
    def expert_dp_rank(self) -> int:
        """This rank's index among the dp ranks that hold the same experts."""
        return self.dp_rank // self.ep

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: dp ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def pp_peer(self, offset: int) -> int:
        """The global rank ``offset`` stages away in this rank's pipeline (wrapping around)."""
        return self.rank_of(self.tp_rank, self.cp_rank, self.dp_rank, (self.pp_rank + offset) % self.pp)

    def group(self, name: str):
        """The process group ``name`` of this rank, or None when it would hold one rank."""
        group = self.groups.get(name)
        if group is None or len(self.group_ranks.get(name, [])) <= 1:
            return None
        return group

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def cp_group(self):
        return self.group("cp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def ep_group(self):
        return self.group("ep")

    @property
    def expert_dp_group(self):
        return self.group("edp")

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp}, cp {self.cp_rank}/{self.cp}"
            + (f" ({self.cp_comm_type})" if self.cp > 1 else "") + ", "
            f"dp {self.dp_rank}/{self.dp}, pp {self.pp_rank}/{self.pp} (vpp {self.vpp}, "
            f"ep {self.ep_rank}/{self.ep}, expert dp {self.expert_dp_rank}/{self.expert_dp})"
        )
