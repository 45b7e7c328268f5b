"""Aux-loss-free load balancing (DeepSeek-V3; Megatron's ``--moe-router-bias-update-rate``): after the
backward of each step, every router's ``expert_bias`` moves by its ``bias_update_rate`` toward
balance, up for an expert chosen for fewer slots than the mean over the step, down for one chosen
for more: ``bias += rate * sign(mean(counts) - counts)``.

The counts are the slots chosen in every training forward since the last update (the router adds
them up, so a step's micro-batches all count), summed over the data- and context-parallel ranks,
which route different tokens; TP ranks route the same gathered tokens, and each pipeline stage
updates its own layers. A forward recomputed for backward counts twice for every expert alike,
which moves no sign. The bias only chooses experts, so the update changes no gradient: Megatron
runs it in ``finalize_model_grads``, here after the gradient sync, before the optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtl.models.moe.router import TopKRouter


@torch.no_grad()
def update_expert_biases(model_chunks: list[nn.Module], group) -> None:
    """Apply the rule to every router with an expert bias in ``model_chunks``; ``group``: the
    data x context parallel group the counts are summed over (None: one rank). A collective:
    every rank of ``group`` calls it after the same step."""
    routers = [m for chunk in model_chunks for m in chunk.modules()
               if isinstance(m, TopKRouter) and m.expert_bias is not None and m.bias_update_rate]
    if not routers:
        return
    counts = torch.stack([router.tokens_since_update for router in routers]).double()  # [routers, E]
    if group is not None:
        dist.all_reduce(counts, group=group)
    direction = torch.sign(counts.mean(dim=-1, keepdim=True) - counts)  # +1: fewer than the mean
    for router, step in zip(routers, direction):
        router.expert_bias.add_((step * router.bias_update_rate).to(router.expert_bias.dtype))
        router.tokens_since_update.zero_()
