"""One engine step's view of the paged cache, passed to the model as its ``inference_context``.

The step's tokens from every scheduled sequence (prefill chunks and single decode tokens alike)
are packed into one row ``[1, T]``; each token carries its own position. The gpt attention
hands its query/key/value to ``attend`` (``mtl.models.gpt.attention``): the new keys and values
go into their slots, then each sequence's queries attend over its own cached tokens, gathered
through its block table, with a causal mask by position. The padded batch ``[sequences,
longest chunk, longest context]`` makes that one fused attention call per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtl.serve.kv_cache import KVPool


@dataclass(frozen=True)
class StepPlan:
    """What one step computes, as plain lists (rank 0 broadcasts it to the other TP ranks)."""

    input_ids: list[int]  # the packed new tokens of every scheduled sequence
    starts: list[int]  # per sequence: position of its first new token (= tokens already cached)
    lengths: list[int]  # per sequence: how many new tokens
    block_tables: list[list[int]]  # per sequence: its blocks, covering start + length tokens
    sample_rows: list[int]  # packed rows whose logits are sampled (a sequence's last token)


class PagedContext:
    def __init__(self, plan: StepPlan, pool: KVPool, block_size: int, device: torch.device):
        self.pool = pool
        # shapes from the plan's lists on the host: no device round trip before the forward
        longest_chunk = max(plan.lengths)
        longest_context = max(start + length for start, length in zip(plan.starts, plan.lengths))
        widest = max(len(t) for t in plan.block_tables)
        padded_tables = [table + [0] * (widest - len(table)) for table in plan.block_tables]
        starts = torch.tensor(plan.starts, device=device)
        lengths = torch.tensor(plan.lengths, device=device)
        tables = torch.tensor(padded_tables, dtype=torch.long, device=device)  # [B, blocks]
        step = torch.arange(longest_chunk, device=device)
        query_valid = step.unsqueeze(0) < lengths.unsqueeze(1)  # [B, Q]
        # packed row of each (sequence, chunk index); padding points at row 0 and is dropped
        offsets = torch.cumsum(lengths, 0) - lengths
        self.query_rows = torch.where(query_valid, offsets.unsqueeze(1) + step, 0)  # [B, Q]
        # a padding query sees key 0 only (every sequence has one): a finite row, thrown away
        query_pos = torch.where(query_valid, starts.unsqueeze(1) + step, 0)  # [B, Q]
        # the real queries' places in the flattened [B * Q] (an index, not a mask: no device sync)
        self.valid = torch.tensor([b * longest_chunk + i for b, n in enumerate(plan.lengths) for i in range(n)],
                                  device=device)
        self.positions = query_pos.reshape(-1)[self.valid].unsqueeze(0)  # [1, T]
        key_pos = torch.arange(longest_context, device=device)
        self.key_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, K]
        self.write_slots = self.key_slots.gather(1, query_pos).reshape(-1)[self.valid]  # [T]
        self.mask = (key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, K]

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [1, T, heads, d], key/value [1, T, groups, d] -> [1, T, heads, d]."""
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        keys[self.write_slots] = key[0].to(keys.dtype)
        values[self.write_slots] = value[0].to(values.dtype)
        q = query[0][self.query_rows].transpose(1, 2)  # [B, heads, Q, d]
        k = keys[self.key_slots].transpose(1, 2).to(q.dtype)  # [B, groups, K, d]
        v = values[self.key_slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=q.shape[1] != k.shape[1])
        batch, heads, chunk, head_dim = out.shape
        out = out.transpose(1, 2).reshape(batch * chunk, heads, head_dim)
        return out[self.valid].unsqueeze(0)  # [1, T, heads, d]

    def advance(self, num_tokens: int) -> None:
        """GPTModel advances a contiguous cache after each forward; positions here come with the plan."""
