"""The model's forward for one step, and the decode-only step at static shapes.

``forward_rows`` runs the gpt model's parts (embedding, rotary, layers) over the packed tokens,
then the final norm and the LM head on the sampled rows only: a prefill chunk of 2,000 tokens
needs one row of logits per sequence, not 2,000 rows of ``vocab`` columns.

``DecodeStep`` runs steps where every sequence adds one token. The batch is padded to a power
of two (1, 2, 4 ... 64 ...) and the widest block table to a power of two of blocks (capped at
one full context), padding pointing at the pool's scratch block, so a step's shapes take few
values. Compiled (``--compile``, on by default on CUDA with TP 1; on CUDA with
``mode="reduce-overhead"``), each bucket pair is recorded once as a CUDA graph and replayed: no
Python and no kernel launches per layer once a bucket has been seen."""

from __future__ import annotations

import torch

from mtl.serve.kv_cache import KVPool
from mtl.serve.paged_attention import DecodeAttention, StepPlan, table_slots, to_device


def forward_rows(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, context,
                 rows: torch.Tensor | None) -> torch.Tensor:
    """input_ids/positions [1, T] -> logits [R, V/tp] of the packed rows ``rows`` (None: all T).

    The pieces of ``GPTModel.forward`` for one stage without labels; the final norm and the LM
    head see only the rows that are sampled."""
    hidden = model.embedding(input_ids, positions)  # [T, 1, h]
    rotary = model.rotary(positions) if model.rotary is not None else None
    hidden = model.layers(hidden, rotary, context)
    if rows is not None:
        hidden = hidden[rows]  # [R, 1, h]
    return model.output_layer(model.final_norm(hidden))[:, 0]


def bucket(n: int) -> int:
    """The smallest power of two holding ``n``."""
    return 1 << max(n - 1, 0).bit_length()


def decode_buckets(max_batch: int, max_blocks: int) -> list[tuple[int, int]]:
    """Every (padded batch, padded table width) a decode step can take."""
    batches = sorted({bucket(b) for b in range(1, max_batch + 1)})
    widths = sorted({min(bucket(w), max_blocks) for w in range(1, max_blocks + 1)})
    return [(b, w) for b in batches for w in widths]


class DecodeStep:
    def __init__(self, model: torch.nn.Module, pool: KVPool, block_size: int, max_blocks: int, scratch_block: int,
                 device: torch.device, compile: bool, max_batch: int):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.max_blocks = max_blocks  # one full context
        self.scratch_block = scratch_block  # padding rows write here and padded tables point here
        self.device = device
        self.compiled = compile
        self.cuda_graphs = compile and device.type == "cuda"
        self._forward = self._logits
        if compile:
            import torch._dynamo

            for cache in (*pool.keys, *pool.values):
                # the pool is written in place by every graph: a fixed address, not an input to copy
                torch._dynamo.mark_static_address(cache)
            # dynamo's automatic dynamic shapes: the first bucket compiles static, the second a graph
            # with a symbolic batch and width that later buckets reuse (sizes of 1 stay their own
            # graphs); CUDA graphs are still recorded per bucket, the shapes their replay needs.
            # The limit only matters if that ever falls back to one graph per bucket.
            buckets = len(decode_buckets(max_batch, max_blocks))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets)
            self._forward = torch.compile(self._logits, mode="reduce-overhead" if self.cuda_graphs else None)

    def __call__(self, plan: StepPlan) -> torch.Tensor:
        """logits [batch, V/tp] of a decode-only plan, in its sequences' order."""
        batch = len(plan.input_ids)
        padded = bucket(batch)
        width = min(bucket(max(len(t) for t in plan.block_tables)), self.max_blocks)
        tables = []
        for table in plan.block_tables:
            tables += table + [self.scratch_block] * (width - len(table))
        pad = padded - batch
        ids, positions, tables = to_device([plan.input_ids + [0] * pad, plan.starts + [0] * pad,
                                            tables + [self.scratch_block] * (width * pad)], self.device)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read already
        return self._forward(ids, positions, tables.view(padded, width))[:batch]

    @torch.no_grad()  # as the runner calls it: graphs compiled for inference, not for autograd
    def warm_up(self, max_batch: int) -> int:
        """Run every (batch, width) bucket once on the scratch block alone, so a server compiles
        and records its graphs before the first request, not during it; how many buckets."""
        buckets = decode_buckets(max_batch, self.max_blocks)
        for batch, width in buckets:
            self(StepPlan([0] * batch, [0] * batch, [1] * batch, [[self.scratch_block] * width] * batch,
                          list(range(batch))))
        return len(buckets)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        slots = table_slots(tables, tables.shape[1] * self.block_size, self.block_size)
        context = DecodeAttention(self.pool, slots, positions, fused=self.compiled)
        return forward_rows(self.model, ids.unsqueeze(0), positions.unsqueeze(0), context, None).float()
