"""What the MoE layers report per training step: aux loss, z-loss and dropped slots.

Each MoE layer adds one record per training forward (``MoEStats.record``; not in eval, not
in the recompute of an activation checkpoint). At each logging step (``logging.interval``)
the trainer calls ``moe_step_metrics(chunks, topology)`` on every rank (a collective over the
pipeline and data/context-parallel groups), which returns and clears what was recorded since
the last call, i.e. over the steps of the interval:

- ``moe_aux_loss``, ``moe_z_loss``: summed over the MoE layers, each layer's mean over the
  interval's forwards (micro-batches), averaged over data/context-parallel ranks (with coefficients: what
  the router adds to the loss). Under context parallelism this is the whole sequence's value,
  as one process would report it: each cp rank's aux loss uses the slot fractions summed over
  the cp group with its own tokens' mean probabilities, so the cp average is the global loss
  (see ``router.py``), and the z-loss is a per-token mean;
- ``moe_dropped_tokens``: slots dropped for capacity in the interval, summed over layers,
  micro-batches, steps and ranks; ``moe_dropped_fraction``: the same over the routed slots.

An empty dict where the model has no experts (``model.num_experts = 0``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MoEStats:
    """Running sums of one MoE layer over the forwards of a step (detached, on the device)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.sums: dict[str, torch.Tensor] = {}

    @torch.compiler.disable
    def record(self, aux_loss: torch.Tensor, z_loss: torch.Tensor, dropped: torch.Tensor, routed: int) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputed inside backward: counted already
            return
        values = {"aux_loss": aux_loss.detach().float(), "z_loss": z_loss.detach().float(),
                  "dropped": dropped.detach().float(), "routed": torch.tensor(float(routed), device=dropped.device)}
        for key, value in values.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.forwards += 1


def moe_step_metrics(chunks: list[nn.Module], topology) -> dict[str, float]:
    """Reduce and clear the MoE layers' records of ``chunks`` (this rank's model chunks)."""
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(getattr(m, "stats", None), MoEStats)]
    config = next((getattr(getattr(chunk, "module", chunk), "config", None) for chunk in chunks), None)
    if config is not None and not config.model.num_experts:
        return {}
    device = next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
    # [aux, z, dropped, routed]: per-layer means of the losses, sums of the counts
    totals = torch.zeros(4, dtype=torch.float32, device=device)
    for layer in layers:
        stats = layer.stats
        if stats.forwards:
            totals += torch.stack([stats.sums["aux_loss"] / stats.forwards, stats.sums["z_loss"] / stats.forwards,
                                   stats.sums["dropped"], stats.sums["routed"]]).to(device)
        stats.reset()
    pp_group, dp_cp_group = topology.group("pp"), topology.group("dp_cp")
    if pp_group is not None:  # stages hold different layers
        dist.all_reduce(totals, group=pp_group)
    if dp_cp_group is not None:  # replicas saw different tokens
        dist.all_reduce(totals, group=dp_cp_group)
        totals[:2] /= dist.get_world_size(dp_cp_group)
    aux, z, dropped, routed = totals.tolist()
    return {"moe_aux_loss": aux, "moe_z_loss": z, "moe_dropped_tokens": dropped,
            "moe_dropped_fraction": dropped / routed if routed else 0.0}
