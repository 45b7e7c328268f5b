"""One engine step's view of the paged cache, passed to the model as its ``inference_context``.

The step's tokens from every scheduled sequence (prefill chunks and single decode tokens alike)
are packed into one row ``[1, T]``; each token carries its own position. The gpt attention
hands its query/key/value to ``attend`` (``mtl.models.gpt.attention``): the new keys and values
go into their slots, then each sequence's queries attend over its own cached tokens, gathered
through its block table.

Two shapes of step:

- ``PagedContext`` (any step with a prompt chunk): the padded batch ``[sequences, longest
  chunk, longest context]`` with a causal mask by position, one SDPA call per layer.
- ``DecodeAttention`` (every sequence adds one token): queries ``[batch, heads, d]`` against
  each sequence's keys up to its position. Its shapes depend only on the batch and table
  width buckets (``decode.py``), so it can be compiled and captured in a CUDA graph.

Every index the step needs is computed on the host from the plan's lists and reaches the
device in one copy (``to_device``); nothing in the layer loop reads a tensor back."""

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

    @property
    def decode_only(self) -> bool:
        """Every sequence adds one token and is sampled: the static-shape decode path."""
        return len(self.input_ids) == len(self.lengths) == len(self.sample_rows)


def to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Integer lists as int64 tensors on ``device`` through one host-to-device copy."""
    flat = torch.tensor([x for part in parts for x in part], dtype=torch.long)
    if device.type == "cuda":  # pinned: the copy is queued without waiting for the host
        flat = flat.pin_memory()
    return list(torch.split(flat.to(device, non_blocking=True), [len(part) for part in parts]))


def table_slots(tables: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """tables [B, W] block ids -> cache slots [B, num_keys] of each sequence's tokens 0 .. num_keys - 1."""
    key_pos = torch.arange(num_keys, device=tables.device)
    return tables[:, key_pos // block_size] * block_size + key_pos % block_size


def gathered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """q [B, heads, Q, d] over the cached keys/values at ``slots`` [B, K] -> [B, heads, Q, d];
    ``mask`` [B, 1, Q, K] is True where a query sees a key."""
    k = keys[slots].transpose(1, 2).to(q.dtype)  # [B, groups, K, d]
    v = values[slots].transpose(1, 2).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class PagedContext:
    """A step with prompt chunks: the padded ``[B, Q, K]`` attention."""

    def __init__(self, plan: StepPlan, pool: KVPool, block_size: int, device: torch.device):
        self.pool = pool
        chunk = max(plan.lengths)
        context = max(start + length for start, length in zip(plan.starts, plan.lengths))
        widest = max(len(t) for t in plan.block_tables)
        query_rows, query_pos, valid, positions, write_slots, tables = [], [], [], [], [], []
        row = 0
        for b, (start, length, table) in enumerate(zip(plan.starts, plan.lengths, plan.block_tables)):
            # padding queries point at packed row 0 and position 0 (key 0 exists for every sequence:
            # a finite row, thrown away)
            query_rows += [row + i if i < length else 0 for i in range(chunk)]
            query_pos += [start + i if i < length else 0 for i in range(chunk)]
            valid += range(b * chunk, b * chunk + length)  # the real queries' places in [B * Q]
            positions += range(start, start + length)
            write_slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + length)]
            tables += table + [0] * (widest - len(table))
            row += length
        (self.input_ids, self.positions, self.write_slots, self.query_rows, query_pos, self.valid, tables,
         self.sample_rows) = to_device([plan.input_ids, positions, write_slots, query_rows, query_pos, valid, tables,
                                        plan.sample_rows], device)
        batch = len(plan.lengths)
        self.input_ids, self.positions = self.input_ids.unsqueeze(0), self.positions.unsqueeze(0)  # [1, T]
        self.query_rows = self.query_rows.view(batch, chunk)
        self.key_slots = table_slots(tables.view(batch, widest), context, block_size)  # [B, K]
        key_pos = torch.arange(context, device=device)
        self.mask = (key_pos.view(1, 1, -1) <= query_pos.view(batch, chunk, 1)).unsqueeze(1)  # [B, 1, Q, K]

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [1, T, heads, d], key/value [1, T, groups, d] -> [1, T, heads, d]."""
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        keys[self.write_slots] = key[0].to(keys.dtype)
        values[self.write_slots] = value[0].to(values.dtype)
        q = query[0][self.query_rows].transpose(1, 2)  # [B, heads, Q, d]
        out = gathered_attention(q, keys, values, self.key_slots, self.mask)
        batch, heads, chunk, head_dim = out.shape
        out = out.transpose(1, 2).reshape(batch * chunk, heads, head_dim)
        return out[self.valid].unsqueeze(0)  # [1, T, heads, d]

    def advance(self, num_tokens: int) -> None:
        """GPTModel advances a contiguous cache after each forward; positions here come with the plan."""


class DecodeAttention:
    """One new token per sequence: ``slots`` [B, K] are each sequence's cache slots (padded
    tables point at the pool's scratch block), ``positions`` [B] its new token's place.
    ``fused``: the form a compiled graph fuses (below); eagerly, SDPA over the gathered keys,
    whose temporaries are smaller."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, positions: torch.Tensor, fused: bool):
        self.pool = pool
        self.fused = fused
        self.slots = slots
        self.write_slots = slots.gather(1, positions.unsqueeze(1)).squeeze(1)  # [B]
        key_pos = torch.arange(slots.shape[1], device=slots.device)
        self.visible = key_pos.unsqueeze(0) <= positions.unsqueeze(1)  # [B, K]

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [1, B, heads, d], key/value [1, B, groups, d] -> [1, B, heads, d].

        Fused, written as a product and a sum, not SDPA over gathered keys: compiled, the block gather
        fuses into the reduction, so each layer reads every cached key and value once from the
        pool instead of copying them out first (the decode step is bound by that traffic)."""
        keys, values = self.pool.keys[layer_number], self.pool.values[layer_number]
        keys[self.write_slots] = key[0].to(keys.dtype)
        values[self.write_slots] = value[0].to(values.dtype)
        batch, heads, head_dim = query.shape[1:]
        if not self.fused:
            out = gathered_attention(query[0].unsqueeze(2), keys, values, self.slots, self.visible[:, None, None])
            return out.reshape(1, batch, heads, head_dim)  # [B, heads, 1, d] -> [1, B, heads, d]
        groups = keys.shape[1]
        q = query[0].float().view(batch, 1, groups, heads // groups, head_dim) * head_dim**-0.5
        k = keys[self.slots].float().unsqueeze(3)  # [B, K, groups, 1, d]
        scores = (q * k).sum(-1)  # [B, K, groups, heads per group]
        scores = scores.masked_fill(~self.visible[:, :, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=1)
        out = (probs.unsqueeze(-1) * values[self.slots].float().unsqueeze(3)).sum(1)  # [B, groups, hpg, d]
        return out.reshape(1, batch, heads, head_dim).to(query.dtype)

    def advance(self, num_tokens: int) -> None:
        """Positions come with the step, as in PagedContext."""
