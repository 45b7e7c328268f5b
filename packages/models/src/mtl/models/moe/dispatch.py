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
over ``mtl.parallel.expert_parallel.TokenExchange``.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many entries of ``expert_ids`` name each expert. A scatter-add rather
    than ``bincount``, whose output size depends on the data and so breaks a compiled graph."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class TokenDispatcher(Protocol):
    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor,
                 keep: torch.Tensor | None, experts: Experts) -> torch.Tensor: ...


def sort_slots(expert_ids: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot numbers of the kept slots ordered by expert (stable: token order within an expert)
    ``[N]``, and their expert ids in that order ``[N]``); slot ``t * k + j`` is token t's j-th choice."""
    flat = expert_ids.reshape(-1)  # [T * k]
    slots = torch.arange(flat.numel(), device=flat.device)
    if keep is not None:
        slots = slots[keep.reshape(-1)]
        flat = flat[slots]
    order = torch.argsort(flat, stable=True)
    return slots[order], flat[order]


def combine_slots(outputs: torch.Tensor, slots: torch.Tensor, probs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert ``outputs [N, h]`` of the ``slots [N]`` -> ``[T, h]``: each weighted by its slot's
    probability (fp32) and summed over the token's ``k`` slots in slot order."""
    num_tokens, top_k = probs.shape
    weighted = outputs.float() * probs.reshape(-1)[slots].unsqueeze(-1)  # [N, h]
    per_slot = weighted.new_zeros(num_tokens * top_k, outputs.shape[-1]).index_copy(0, slots, weighted)
    return per_slot.view(num_tokens, top_k, -1).sum(dim=1).to(out_dtype)  # [T, h]


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
    from mtl.models.moe.alltoall_dispatch import AllToAllDispatcher  # noqa: PLC0415 (it imports this module)

    return AllToAllDispatcher(num_experts=num_experts, topology=topology)
