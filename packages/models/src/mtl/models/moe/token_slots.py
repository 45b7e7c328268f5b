"""What every token dispatcher shares (dispatch.py describes the interface): the ``TokenDispatcher``
protocol, the ``Experts`` callable it is handed, and the slot arithmetic: counting slots per
expert, ordering the kept slots by expert, and summing the expert outputs back per token.
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
