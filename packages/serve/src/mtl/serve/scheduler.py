"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step, each running sequence that is decoding gets its one token first, then sequences
still reading their prompt get chunks of it, then waiting requests are admitted (up to
``max_batch`` running, while the pool can reserve their worst case) with the rest of the
step's token budget. A long prompt is thus read over several steps while decodes keep going,
and a request joins or leaves at any step."""

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

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt_ids)

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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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
        self.blocks.free(seq.id)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, how many of its pending tokens) for the next step."""
        budget = self.max_step_tokens
        chosen = [(seq, 1) for seq in self.running if not seq.prefilling]
        budget -= len(chosen)
        for seq in self.running:
            if seq.prefilling and budget > 0:
                count = min(len(seq.prompt_ids) - seq.cached, budget)
                chosen.append((seq, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            worst_case = len(seq.prompt_ids) + seq.max_tokens
            if not self.blocks.can_reserve(worst_case):
                break  # first come, first served: it waits for blocks to come back
            self.waiting.popleft()
            self.blocks.reserve(seq.id, worst_case)
            self.running.append(seq)
            count = min(len(seq.prompt_ids), budget)
            chosen.append((seq, count))
            budget -= count
        return chosen
