"""The token dispatcher for expert parallelism (``parallel.ep > 1``; interface in
``dispatch.py``): each kept slot goes to the ep rank holding its expert through a
variable-split all-to-all, that rank's local experts run on what arrived, and the outputs
come back and are combined exactly as ``LocalDispatcher`` combines them, so ep changes only
where an expert runs, never the sum.

Under TP every TP rank holds the same tokens and routes them alike; each exchanges with the
ranks of its own ep group (the same tp rank), so the experts' TP shards see the same rows.

The exchange's split sizes are host integers (both NCCL and gloo need them), so each MoE
layer synchronises with the device once per forward (as Megatron's all-to-all dispatcher
does). The row counts change every step, so under ``train.compile`` the dispatcher and the
experts it calls run eagerly (``torch.compiler.disable``) rather than recompiling for each
new count; the rest of the layer stays compiled.
"""

from __future__ import annotations

import torch

from mtl.models.moe.token_slots import Experts, combine_slots, count_per_expert, sort_slots
from mtl.parallel.expert_parallel import TokenExchange


class AllToAllDispatcher:
    def __init__(self, num_experts: int, topology) -> None:
        self.num_experts = num_experts
        self.group = topology.group("ep")

    @torch.compiler.disable
    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor,
                 keep: torch.Tensor | None, experts: Experts) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        slots, sorted_ids = sort_slots(expert_ids, keep)  # by global expert, so by ep rank
        exchange = TokenExchange(count_per_expert(sorted_ids, self.num_experts), self.group)
        local = exchange.dispatch(hidden[slots // top_k])  # [M, h] for this rank's experts
        outputs = exchange.combine(experts(local, exchange.tokens_per_local_expert))  # [N, h]
        return combine_slots(outputs, slots, probs, hidden.dtype)
