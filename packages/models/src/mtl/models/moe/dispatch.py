"""Token dispatch: the one place where tokens meet their experts, and where expert
parallelism plugs in its all-to-all.

The interface (``TokenDispatcher``), called once per MoE layer forward::

    combined = dispatcher(hidden, probs, expert_ids, keep, experts)

- ``hidden [T, h]``: this rank's tokens (under TP the full, TP-replicated set: every TP rank
  calls the dispatcher with the same tokens);
- ``probs [T, k]`` fp32: each routed slot's weight; ``expert_ids [T, k]`` int64: its global
  expert number in ``[0, num_experts)``; ``keep [T, k]`` bool or None: the slots within capacity
  (None: dropless, every slot is sent);
- ``experts(tokens [N, h], tokens_per_expert [E/ep] int64) -> [N, h]``: runs THIS rank's
  ``E/ep`` local experts on tokens sorted by local expert (``tokens_per_expert`` on the tokens'
  device, summing to N) and returns complete outputs (already reduced over TP); a differentiable
  callable supplied by the MoE layer;
- returns ``combined [T, h]`` in ``hidden``'s dtype: for each token, ``sum_k probs[t, k] *
  expert_{expert_ids[t, k]}(hidden[t])`` over its kept slots (the weighted sum in fp32).

``LocalDispatcher`` (ep = 1): permute the kept slots by expert, run the experts, weight, and
sum each token's slots back in slot order (deterministic: no atomic scatter-add).
With ``parallel.ep > 1`` an all-to-all dispatcher sends each slot to the rank holding its
expert (rank j holds experts ``[j * E/ep, (j + 1) * E/ep)``), calls ``experts`` on what it
received for its local experts with their ``tokens_per_expert`` counts, sends the outputs
back and combines as here: ``alltoall_dispatch.AllToAllDispatcher(num_experts=..., topology=...)``,
over ``mtl.parallel.expert_parallel.TokenExchange``. Both share token_slots.py's slot arithmetic.
"""

from __future__ import annotations

import torch

from mtl.models.moe.alltoall_dispatch import AllToAllDispatcher
from mtl.models.moe.token_slots import Experts, TokenDispatcher, combine_slots, count_per_expert, sort_slots


class LocalDispatcher:
    """Every expert lives on this rank (``parallel.ep = 1``)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor,
                 keep: torch.Tensor | None, experts: Experts) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        slots, sorted_ids = sort_slots(expert_ids, keep)
        tokens_per_expert = count_per_expert(sorted_ids, self.num_experts)  # [E]
        outputs = experts(hidden[slots // top_k], tokens_per_expert)  # [N, h]
        return combine_slots(outputs, slots, probs, hidden.dtype)


def build_dispatcher(num_experts: int, topology) -> TokenDispatcher:
    """The dispatcher for this rank's layout: local at ep = 1, the all-to-all one otherwise."""
    ep = getattr(topology, "ep", 1) if topology is not None else 1
    if ep == 1:
        return LocalDispatcher(num_experts)
    return AllToAllDispatcher(num_experts=num_experts, topology=topology)
