"""Where a rank's optimizer moments sit in a checkpoint: a flat range of each parameter.

The distributed optimizer owns flat ranges of parameters (``param.view(-1)[first:last]``),
which are not boxes of the parameter's shape, so both optimizer paths describe their moments
as 1-D ranges of one flat global tensor per parameter:

- a replicated parameter (no ``param.tp_split_dim``): the flattened parameter,
  ``global_shape = (numel,)``, ``global_offset = (first,)``;
- a TP-split parameter: the TP shards' flattenings one after another in ``tp_rank`` order,
  ``global_shape = (tp * numel_local,)``, ``global_offset = (tp_rank * numel_local + first,)``.
  For a split along dim 0 (column-parallel weights, vocab-parallel embeddings) this is exactly
  the flattened global tensor.

A checkpoint written by either path, at any data-parallel size, loads into either path at
any data-parallel size with the same TP degree.
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.parallel.topology import Topology

MOMENTS = ("exp_avg", "exp_avg_sq")


def flat_global_range(
    param: nn.Parameter, first: int, topology: Topology
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global_shape, global_offset) of ``param.view(-1)[first:...]`` in the flat layout."""
    numel = param.numel()
    if getattr(param, "tp_split_dim", None) is None or topology.tp == 1:
        return (numel,), (first,)
    return (topology.tp * numel,), (topology.tp_rank * numel + first,)


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
