"""How optimizer state is described for checkpoints: whole moments per parameter, in the
parameter's own shape, whatever the optimizer shards.

Both optimizer paths offer the same two views of their AdamW moments:

- ``full_moments()``: every parameter's complete moments, shaped like the parameter (the TP
  shard of it). The replicated optimizer has them; the distributed optimizer all-gathers them
  over the data x context-parallel group one bucket at a time (a collective). A checkpoint
  stores them like the weights, in the layout-independent global shape, so any layout reads them.
- ``state_pieces()``: the live moments this rank updates, as flat ranges of parameters
  (``MomentPiece``): the whole parameter for the replicated optimizer, this rank's shard for
  the distributed one. Loading into them in place restores the state, reading only those ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(eq=False)
class MomentPiece:
    """The live moments of ``source.view(-1)[first:first + n]``: ``moments[name]`` is a 1-D
    view of n elements of the optimizer's state (writing it writes the state)."""

    source: nn.Parameter
    name: str
    first: int
    moments: dict[str, torch.Tensor]


def ensure_adamw_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict:
    """The AdamW state of ``param``, created as a fresh start (step 0, zero moments) if the
    optimizer has not stepped yet, so a checkpoint can be loaded into it in place."""
    state = optimizer.state[param]
    if not state:
        fused = any(g.get("fused") for g in optimizer.param_groups)
        # torch keeps `step` as a CPU scalar unless fused/capturable, where it lives on the device.
        step_device = param.device if fused else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state
