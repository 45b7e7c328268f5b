"""T5's relative position bias: each (query, key) distance falls in one of ``num_buckets``
buckets (exact for short distances, logarithmic up to ``max_distance``, one bucket beyond;
bidirectional attention gives each direction half of them), and each bucket holds one learned
scalar per head, added to the attention scores. The table ``[num_buckets, heads]`` is split over
TP by heads, as the attention's heads are."""

from __future__ import annotations

import math

import torch
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.parallel.param_layout import set_param_layout


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """relative_position = key position - query position (int64, any shape) -> bucket ids."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets  # keys after the query: the upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # a causal query sees only earlier keys
    max_exact = num_buckets // 2
    # distances past max_exact share buckets on a log scale, up to max_distance
    scaled = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    def __init__(self, *, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool, topology):
        super().__init__()
        tp = topology.tp if topology is not None else 1
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads // tp))  # [buckets, heads/tp]
        tag_init(self.weight, "normal")
        set_param_layout(self.weight, tp_split_dim=1)

    def forward(self, query_length: int, key_length: int, offset: int = 0) -> torch.Tensor:
        """-> [1, heads/tp, q, k] fp32 (queries at positions ``offset ..``, keys from 0)."""
        device = self.weight.device
        query = torch.arange(offset, offset + query_length, device=device)[:, None]
        key = torch.arange(key_length, device=device)[None, :]
        bucket = relative_position_bucket(key - query, bidirectional=self.bidirectional,
                                          num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.weight[bucket].permute(2, 0, 1).unsqueeze(0).float()  # [q, k, heads] -> [1, heads, q, k]
