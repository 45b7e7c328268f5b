"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step, each running sequence that is decoding gets its one token first, then sequences
still reading their prompt get chunks of it, then waiting requests are admitted (up to
``max_batch`` running, while the pool can reserve their worst case) with the rest of the
step's token budget. A long prompt is thus read over several steps while decodes keep going,
and a request joins or leaves at any step.

Reservations (``kv_cache.py``). A request that gives ``max_tokens`` reserves its worst case at
admission and is never preempted. One that gives none (a chat: vLLM's rule, it may run to
the end of the context) would reserve a whole context if treated alike, and one such request
could hold most of the pool while using a few blocks, keeping every other request waiting.
So it reserves what it reads and one block more, and grows its reservation a block at a
time; when a decode needs a block and none is unreserved, the youngest running request
without ``max_tokens`` is preempted: its blocks go back, and it is admitted again before any
new request, to be recomputed (prompt and the tokens it has, read again as a prompt, then it
goes on sampling where it stopped). Preempted requests wait in a line of their own, which
``max_waiting`` does not count: a request the server took is never refused later. Bounded
requests thus keep their guarantee, an unbounded one holds only what it uses, and a
preempted one is first in line, so it is not starved either: one context always fits the
pool (checked at startup)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mtl.serve.detokenize import TextStream
from mtl.serve.kv_cache import BlockManager
from mtl.serve.sampling import SamplingParams, TokenLogprobs


@dataclass(eq=False)
class Sequence:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    generator: torch.Generator
    text: TextStream | None  # None: the request asked for token ids only
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in the cache
    finish_reason: str | None = None
    prefill_len: int = 0  # tokens read before sampling: the prompt, or everything so far after a preemption

    def __post_init__(self):
        self.prefill_len = len(self.prompt_ids)

    @property
    def elastic(self) -> bool:
        """No max_tokens: it reserves blocks as it grows and may be preempted."""
        return self.params.max_tokens is None

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_len

    def pending_ids(self, count: int) -> list[int]:
        start, end, prompt = self.cached, self.cached + count, len(self.prompt_ids)
        if start >= prompt:  # decoding: no copy of the whole prompt every step
            return self.output_ids[start - prompt: end - prompt]
        return self.prompt_ids[start:end] + self.output_ids[: max(end - prompt, 0)]


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_batch: int, max_step_tokens: int, max_waiting: int):
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()  # new requests: what max_waiting bounds
        # preempted requests, admitted before any new one; kept apart so that a preemption never
        # fills the queue that the server already promised a new request a place in
        self.requeued: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def queue_full(self) -> bool:
        return len(self.waiting) >= self.max_waiting

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Out of the queue or the batch, its blocks back in the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.requeued:
            self.requeued.remove(seq)
        self.blocks.free(seq.id)

    def _preempt(self, seq: Sequence) -> None:
        """Back to the head of the line with no blocks; it reads all its tokens again."""
        self.running.remove(seq)
        self.blocks.free(seq.id)
        seq.cached, seq.prefill_len = 0, seq.total_tokens
        self.requeued.appendleft(seq)
        self.preemptions += 1

    def _reserve_decode_blocks(self) -> None:
        """Every decoding elastic sequence's next token reserved, preempting the youngest
        elastic ones (itself at worst) while the pool has too few unreserved blocks."""
        for seq in list(self.running):
            if seq not in self.running or not seq.elastic or seq.prefilling:
                continue
            while not self.blocks.extend(seq.id, seq.cached + 1):
                victim = next(s for s in reversed(self.running) if s.elastic)
                self._preempt(victim)
                if victim is seq:
                    break

    def _reservation(self, seq: Sequence) -> int:
        """Tokens reserved at admission: a bounded request's worst case; an elastic one's
        tokens plus one block, so that a request read again after a preemption decodes a
        block's worth of tokens before it needs another (reserving only what it reads, its
        next decode could cross a block boundary and preempt it again: a re-read per token)."""
        worst = len(seq.prompt_ids) + seq.max_tokens
        return min(seq.prefill_len + self.blocks.block_size, worst) if seq.elastic else worst

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, how many of its pending tokens) for the next step."""
        self._reserve_decode_blocks()
        budget = self.max_step_tokens
        chosen = [(seq, 1) for seq in self.running if not seq.prefilling]
        budget -= len(chosen)
        for seq in self.running:
            if seq.prefilling and budget > 0:
                count = min(seq.prefill_len - seq.cached, budget)
                chosen.append((seq, count))
                budget -= count
        while (line := self.requeued or self.waiting) and budget > 0 and len(self.running) < self.max_batch:
            seq = line[0]
            if not self.blocks.can_reserve(self._reservation(seq)):
                break  # first come, first served: it waits for blocks to come back
            line.popleft()
            self.blocks.reserve(seq.id, self._reservation(seq))
            self.running.append(seq)
            count = min(seq.prefill_len, budget)
            chosen.append((seq, count))
            budget -= count
        return chosen
