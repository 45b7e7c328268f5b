"""What every rank decides together after a step, in one all-reduce: stop (a signal reached
some rank), skip or stop on a NaN/Inf step (and which rank saw it first), save by the clock."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtl.parallel.topology import Topology


@dataclass
class Agreement:
    stop: bool = False  # some rank got SIGTERM/SIGINT
    origin: int | None = None  # lowest rank whose own loss was NaN/Inf
    loss_bad: bool = False
    grad_bad: bool = False
    time_due: bool = False  # rank 0's clock says ckpt.interval_minutes passed

    @property
    def bad(self) -> bool:
        return self.loss_bad or self.grad_bad

    def bad_step_message(self, grad_norm: float, iteration: int) -> str:
        """The same words on every rank (a non-last pipeline stage has no loss of its own)."""
        what = (["loss"] if self.loss_bad else []) + ([f"gradient norm ({grad_norm})"] if self.grad_bad else [])
        where = (f"first seen in rank {self.origin}'s loss" if self.origin is not None
                 else "the gradient norm is global: every rank sees it")
        return f"non-finite {' and '.join(what)} at step {iteration} ({where})"


def agree(topology: Topology, device: torch.device, *, stop: bool, origin: bool, loss_bad: bool, grad_bad: bool,
          time_due: bool) -> Agreement:
    """Each flag OR-ed over the ranks; ``origin`` becomes the lowest rank that raised it."""
    t = topology
    values = [float(stop), float(t.world_size - t.rank) if origin else 0.0, float(loss_bad), float(grad_bad),
              float(time_due and t.rank == 0)]
    if dist.is_initialized():
        flags = torch.tensor(values, dtype=torch.float32, device=device)  # exact for ranks < 2**24
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
    return Agreement(stop=values[0] > 0, origin=int(t.world_size - values[1]) if values[1] > 0 else None,
                     loss_bad=values[2] > 0, grad_bad=values[3] > 0, time_due=values[4] > 0)
