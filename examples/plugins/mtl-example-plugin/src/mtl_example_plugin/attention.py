"""Attention written out as matmul + softmax, for one process (tp rank-local heads).

Follows the ``core_attention`` contract of ``mtl.core.registrations.Backend``: q
``[b, s_q, heads, d]``, k and v ``[b, s_kv, groups, d]`` -> ``[b, s_q, heads, d]``. Grouped-query
attention is supported (each K/V head serves ``heads / groups`` consecutive query heads), and
so is a KV cache (``s_q < s_kv``: the causal mask is aligned to the last positions, as in the
local backend). What it does not do, it refuses when built, naming the setting:

- context parallelism (``parallel.cp > 1``): there is no ring attention here;
- attention dropout together with tensor parallelism (``model.attention_dropout > 0`` and
  ``parallel.tp > 1``): the dropout masks would need the TP-split RNG stream of
  ``mtl.parallel.random``, which this example does not use.
"""

from __future__ import annotations

import math

import torch

from mtl.core.errors import ConfigError


class EagerAttention(torch.nn.Module):
    def __init__(
        self,
        *,
        num_heads: int,
        num_query_groups: int,
        head_dim: int,
        causal: bool = True,
        dropout: float = 0.0,
        topology=None,
        softmax_scale: float | None = None,
    ):
        super().__init__()
        cp, tp = getattr(topology, "cp", 1), getattr(topology, "tp", 1)  # topology None: one process
        if cp > 1:
            raise ConfigError(
                f"the 'eager' backend has no context parallelism (parallel.cp = {cp}); "
                "use parallel.cp = 1 or model.backend = 'local'"
            )
        if dropout > 0 and tp > 1:
            raise ConfigError(
                f"the 'eager' backend does not support model.attention_dropout = {dropout} with "
                f"parallel.tp = {tp} (it has no TP-split RNG stream); set model.attention_dropout = 0 "
                "or use model.backend = 'local'"
            )
        if num_query_groups < 1 or num_heads % num_query_groups:
            raise ConfigError(
                f"the 'eager' backend needs num_heads ({num_heads}) to be a multiple of "
                f"num_query_groups ({num_query_groups}) per TP rank; fix model.num_query_groups"
            )
        self.num_heads = num_heads
        self.num_query_groups = num_query_groups
        self.head_dim = head_dim
        self.causal = causal
        self.dropout = dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, groups = q.shape[2], k.shape[2]
        if heads != self.num_heads or groups != self.num_query_groups:
            raise ValueError(
                f"EagerAttention built for {self.num_heads} heads / {self.num_query_groups} groups, "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if groups != heads:  # grouped-query attention: each K/V head serves heads/groups queries
            k = k.repeat_interleave(heads // groups, dim=2)
            v = v.repeat_interleave(heads // groups, dim=2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, heads, s, d]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale  # [b, h, s_q, s_kv]
        if self.causal:
            s_q, s_kv = scores.shape[-2], scores.shape[-1]
            # query i is position s_kv - s_q + i; it may not see keys after it
            mask = torch.ones(s_q, s_kv, dtype=torch.bool, device=scores.device).triu(s_kv - s_q + 1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0:
            probs = torch.nn.functional.dropout(probs, self.dropout)
        out = torch.matmul(probs, v.float()).to(q.dtype)
        return out.transpose(1, 2)  # [b, s_q, heads, d]

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, groups={self.num_query_groups}, head_dim={self.head_dim}, "
            f"causal={self.causal}, dropout={self.dropout}"
        )
