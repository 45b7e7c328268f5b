"""The few collectives a save needs, working with or without torch.distributed.

A single process without an initialised default group is a world of one: every call here
then degenerates to the local answer, so ``save`` runs unchanged in a notebook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mtl.core.errors import CheckpointError


@dataclass(frozen=True)
class SaveGroup:
    """The ranks that save one checkpoint together; rank 0 of the group coordinates."""

    group: Any  # a torch ProcessGroup, or None for the default group / a single process
    rank: int
    world_size: int

    @classmethod
    def resolve(cls, process_group: Any = None) -> "SaveGroup":
        if not (dist.is_available() and dist.is_initialized()):
            return cls(group=None, rank=0, world_size=1)
        return cls(
            group=process_group,
            rank=dist.get_rank(process_group),
            world_size=dist.get_world_size(process_group),
        )

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group-rank order (a list of one without a process group)."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def agree_on_failures(self, error: str | None, phase: str) -> None:
        """A barrier that also carries failures: if any rank failed ``phase``, every rank raises.

        A plain barrier would leave the healthy ranks waiting forever for a rank that raised;
        gathering each rank's error message instead lets all of them stop together and name
        the rank that failed.
        """
        errors = self.all_gather_object(error)
        failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
        if failed:
            detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed[:4])
            raise CheckpointError(f"checkpoint save failed while {phase} ({detail}); the previous checkpoint is untouched")
