"""Bidirectional core attention with a key padding mask, around the backend's own.

gpt's ``SelfAttention`` (fused QKV, output projection) is reused as it is; only its
``core_attention`` leaf is this module. The layer hands it the key padding mask of the
micro-batch (``set_padding_mask``) right before calling the attention, inside the same layer
call, so a recomputed layer (``train.recompute = 'full'``) sets the same mask again.

- No padding in the micro-batch: the backend's core attention, built non-causal.
- Padding: PyTorch's fused attention with a boolean mask over the keys (``True``: a real
  token). Under context parallelism every rank holds two chunks of the sequence; attention is
  not causal, so the order of the keys does not matter and the keys, values and their mask are
  all-gathered over the cp group (the gather's backward sums dK/dV over it).

Selective recompute (``train.recompute = 'selective'``) checkpoints this module's call with
the mask as an argument, so the backward's recomputation uses the same mask.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from mtl.core.spec import build_module
from mtl.models.gpt.recompute import checkpointed
from mtl.parallel.random import get_rng_tracker


class PaddedCoreAttention(nn.Module):
    def __init__(self, *, num_heads: int, num_query_groups: int, head_dim: int, dropout: float, topology,
                 backend_attention, recompute: bool = False, causal: bool = False):
        super().__init__()
        del causal  # gpt's SelfAttention asks for causal attention; an encoder's is bidirectional
        self.inner = build_module(
            backend_attention, num_heads=num_heads, num_query_groups=num_query_groups, head_dim=head_dim,
            causal=False, dropout=dropout, topology=topology,
        )
        self.num_heads, self.num_query_groups = num_heads, num_query_groups
        self.dropout = dropout
        # train.recompute = 'selective', done here rather than by gpt's SelfAttention: the mask
        # must be an argument of the recomputed call (the attribute is gone by the backward)
        self.recompute = recompute
        self.tp_split = topology is not None and topology.tp > 1
        self.cp_group = topology.group("cp") if topology is not None and topology.cp > 1 else None
        self.padding_mask: torch.Tensor | None = None  # [b, s(/cp)] bool, True: a real token

    def set_padding_mask(self, padding_mask: torch.Tensor | None) -> None:
        self.padding_mask = padding_mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, s, heads, d], k/v [b, s, groups, d] (local heads, local sequence) -> [b, s, heads, d]."""
        if self.recompute and self.training:
            return checkpointed(self._attend, q, k, v, self.padding_mask)
        return self._attend(q, k, v, self.padding_mask)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # the micro-batch has no padding (the model checks once)
            return self.inner(q, k, v)
        if self.cp_group is not None:
            k = torch.cat(dist_fn.all_gather(k.contiguous(), group=self.cp_group), dim=1)  # [b, s, groups, d]
            v = torch.cat(dist_fn.all_gather(v.contiguous(), group=self.cp_group), dim=1)
            masks = [torch.empty_like(mask) for _ in range(dist.get_world_size(self.cp_group))]
            dist.all_gather(masks, mask.contiguous(), group=self.cp_group)
            mask = torch.cat(masks, dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
        if self.num_heads != self.num_query_groups:
            repeat = self.num_heads // self.num_query_groups
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        # heads are split over TP: their dropout masks come from the TP stream, as the backend's do
        stream = get_rng_tracker().fork() if dropout_p > 0.0 and self.tp_split else contextlib.nullcontext()
        with stream:
            # [b, s_kv] -> [b, 1, 1, s_kv]: every query (and head) sees the batch row's real keys
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], dropout_p=dropout_p)
        return out.transpose(1, 2)
