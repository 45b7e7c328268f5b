"""Runs one step's plan through this rank's part of the model.

Under tensor parallelism every rank holds its heads' keys and values and a slice of the
vocabulary: rank 0 plans and samples, broadcasts each plan, every rank runs the same forward
(the layers' own collectives keep them in step), and the sampled rows' logits are gathered
over the TP group. ``follow`` is the loop of the other ranks.

A step with prompt chunks runs eagerly over ``PagedContext``; a decode-only step goes through
``DecodeStep`` (bucketed shapes, compiled when asked). Either way only the sampled rows reach
the final norm and the LM head."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtl.serve.decode import DecodeStep, forward_rows
from mtl.serve.kv_cache import KVPool
from mtl.serve.paged_attention import PagedContext, StepPlan

STOP = "stop"  # the plan that ends the followers' loop


class ModelRunner:
    def __init__(self, model: torch.nn.Module, topology, pool: KVPool, block_size: int, device: torch.device,
                 decode: DecodeStep):
        self.model = model
        self.decode = decode
        self.topology = topology
        self.pool = pool
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.model.vocab_size

    @property
    def distributed(self) -> bool:
        return self.topology.tp > 1

    def broadcast(self, plan: StepPlan | str) -> StepPlan | str:
        """Rank 0's plan on every rank."""
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.topology.tp_group, 0),
                                   group=self.topology.tp_group)
        return box[0]

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """fp32 logits [len(sample_rows), vocab] of the plan's sampled rows (on every rank)."""
        if self.distributed and self.topology.tp_rank == 0:
            self.broadcast(plan)
        if plan.decode_only:
            rows = self.decode(plan)
        else:
            context = PagedContext(plan, self.pool, self.block_size, self.device)
            rows = forward_rows(self.model, context.input_ids, context.positions, context, context.sample_rows)
        rows = rows.float()  # [R, V/tp]
        if self.distributed:
            parts = [torch.empty_like(rows) for _ in range(self.topology.tp)]
            dist.all_gather(parts, rows.contiguous(), group=self.topology.tp_group)
            rows = torch.cat(parts, dim=-1)
        return rows[:, : self.vocab_size]  # padding rows are never sampled

    def follow(self) -> None:
        """A rank other than 0: run rank 0's plans until it says stop."""
        while True:
            plan = self.broadcast(None)
            if plan == STOP:
                return
            self.execute(plan)

    def stop_followers(self) -> None:
        if self.distributed and self.topology.tp_rank == 0:
            self.broadcast(STOP)
