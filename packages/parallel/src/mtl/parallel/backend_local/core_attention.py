"""Softmax attention over local heads with PyTorch's fused scaled-dot-product kernels.

Input and output follow the Backend contract: q ``[b, s, heads, d]``, k and v
``[b, s_kv, groups, d]`` (grouped-query attention: each group of ``heads / groups``
consecutive query heads shares one K/V head), output ``[b, s, heads, d]``. With context
parallelism (``topology.cp > 1``) the work goes to ``mtl.parallel.context_parallel``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.random import get_rng_tracker

# enable_gqa arrived in torch 2.5 (documented in the function's docstring, which is the only
# place a builtin exposes it); before it K/V heads are expanded by hand.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def bottom_right_causal_mask(s_q: int, s_kv: int, device: torch.device) -> torch.Tensor:
    """[s_q, s_kv] bool, True where query i (the last s_q positions) may see key j."""
    q_pos = torch.arange(s_kv - s_q, s_kv, device=device).unsqueeze(1)
    return torch.arange(s_kv, device=device).unsqueeze(0) <= q_pos


class CoreAttention(nn.Module):
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
        if num_heads % num_query_groups:
            raise ParallelError(
                f"CoreAttention: num_heads = {num_heads} is not a multiple of num_query_groups = "
                f"{num_query_groups} (local, per-TP-rank counts); fix model.num_query_groups"
            )
        self.num_heads = num_heads
        self.num_query_groups = num_query_groups
        self.head_dim = head_dim
        self.causal = causal
        self.dropout = dropout
        self.topology = topology
        self.softmax_scale = softmax_scale
        # heads are split over TP, so dropout on their probabilities uses the TP stream
        self._tp_split = topology is not None and topology.tp > 1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s_q, heads, d = q.shape
        if heads != self.num_heads or k.shape[2] != self.num_query_groups or d != self.head_dim:
            raise ParallelError(
                f"CoreAttention expected q [b, s, {self.num_heads}, {self.head_dim}] and k/v "
                f"[b, s, {self.num_query_groups}, {self.head_dim}], got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        dropout_p = self.dropout if self.training else 0.0
        if self.topology is not None and self.topology.cp > 1:
            from mtl.parallel.context_parallel import context_parallel_attention  # written separately

            return context_parallel_attention(
                q, k, v, topology=self.topology, causal=self.causal, dropout_p=dropout_p, softmax_scale=self.softmax_scale
            )
        if dropout_p > 0.0 and self._tp_split:
            # fork() raises, naming seed_everything, when the stream was never seeded: silently
            # dropping the same positions on every TP rank would correlate the heads' masks
            tracker = get_rng_tracker()
            if tracker.device.type != q.device.type:
                raise ParallelError(
                    f"CoreAttention runs on {q.device} but the RNG tracker holds {tracker.device} "
                    "streams; call mtl.parallel.random.seed_everything(seed, topology, device=...) "
                    "with the model's device"
                )
            with tracker.fork():
                return self._attend(q, k, v, dropout_p)
        return self._attend(q, k, v, dropout_p)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        s_q, s_kv = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, s, n, d] -> [b, n, s, d]
        gqa = self.num_heads != self.num_query_groups
        kwargs = {}
        if gqa and _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        elif gqa:
            repeat = self.num_heads // self.num_query_groups
            k = k.repeat_interleave(repeat, dim=1)  # [b, groups, s, d] -> [b, heads, s, d]
            v = v.repeat_interleave(repeat, dim=1)
        mask = None
        is_causal = False
        if self.causal and s_q == s_kv:
            is_causal = True
        elif self.causal and s_q > 1:
            # decoding with a KV cache: the queries are the last s_q positions
            mask = bottom_right_causal_mask(s_q, s_kv, q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale, **kwargs
        )
        return out.transpose(1, 2)  # [b, heads, s, d] -> [b, s, heads, d]

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, groups={self.num_query_groups}, head_dim={self.head_dim}, "
            f"causal={self.causal}, dropout={self.dropout}"
        )
