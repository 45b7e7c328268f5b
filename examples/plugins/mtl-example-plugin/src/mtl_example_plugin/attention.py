"""Attention written out as matmul + softmax, for one process (tp rank-local heads)."""

from __future__ import annotations

import math

import torch

from mtl.core.errors import ConfigError


class EagerAttention(torch.nn.Module):
    def __init__(self, *, num_heads, num_query_groups, head_dim, causal=True, dropout=0.0, topology=None, **_):
        super().__init__()
        if topology is not None and topology.cp > 1:
            raise ConfigError("the 'eager' backend has no context parallelism; use model.backend = 'local'")
        self.causal = causal
        self.dropout = dropout
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, q, k, v):
        # q [b, s, heads, d], k/v [b, s, groups, d] -> [b, s, heads, d]
        heads, groups = q.shape[2], k.shape[2]
        if groups != heads:  # grouped-query attention: each K/V head serves heads/groups queries
            k = k.repeat_interleave(heads // groups, dim=2)
            v = v.repeat_interleave(heads // groups, dim=2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, heads, s, d]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if self.causal:
            s = scores.shape[-1]
            mask = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0:
            probs = torch.nn.functional.dropout(probs, self.dropout)
        out = torch.matmul(probs, v.float()).to(q.dtype)
        return out.transpose(1, 2)
