"""Whether each token's label is the top prediction, with the logits split over TP by vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def vocab_parallel_hits(logits: torch.Tensor, target: torch.Tensor, topology, vocab_size: int) -> torch.Tensor:
    """logits [..., V/tp] (padded rows past ``vocab_size`` ignored), target [...] -> 1.0 where the
    target's logit is the largest over the whole vocabulary, else 0.0 (fp32, shaped like target)."""
    vocab_local = logits.shape[-1]
    tp, tp_rank = (topology.tp, topology.tp_rank) if topology is not None else (1, 0)
    start = tp_rank * vocab_local
    real = max(0, min(vocab_local, vocab_size - start))
    logits = logits[..., :real].float()
    best = logits.max(dim=-1).values if real else torch.full(target.shape, float("-inf"), device=logits.device)
    local_target = target - start
    owned = (local_target >= 0) & (local_target < real)
    picked = torch.gather(logits, -1, local_target.clamp(0, max(real - 1, 0)).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(owned, picked, torch.full_like(picked, float("-inf")))
    if tp > 1:
        both = torch.stack([best, target_logit])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=topology.tp_group)
        best, target_logit = both[0], both[1]
    return (target_logit >= best).float()
