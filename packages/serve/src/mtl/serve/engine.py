"""The engine: requests in, tokens out, one continuous-batching step at a time.

``add`` checks a request and queues it; ``step`` schedules (``scheduler.py``), runs the packed
forward over the paged cache (``runner.py``), samples every sequence that reached its last
pending token (``sampling.py``), and returns what each request gained; ``abort`` drops a
request and returns its blocks at once. The engine is not thread-safe: one thread drives it
(``engine_loop.py`` for the server, a plain loop for offline batches)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from mtl.core.errors import MtlError
from mtl.serve.decode import DecodeStep
from mtl.serve.detokenize import TextStream
from mtl.serve.kv_cache import BlockManager, KVPool, kv_budget_bytes
from mtl.serve.loading import LoadedModel
from mtl.serve.paged_attention import StepPlan
from mtl.serve.runner import ModelRunner
from mtl.serve.sampling import SamplingParams, TokenLogprobs, make_generator, sample_rows
from mtl.serve.scheduler import Scheduler, Sequence


class RequestError(MtlError):
    """A request the engine cannot run; ``param`` names the field at fault (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class QueueFull(MtlError):
    """The waiting queue is at ``max_waiting`` (HTTP 429)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # sequences running at once
    max_step_tokens: int = 512  # tokens one step computes: decodes first, then prompt chunks
    block_size: int = 16  # tokens per KV block
    kv_memory: str = "0.9"  # a fraction of free GPU memory, or a size (256MiB) for the KV pool
    max_waiting: int = 256  # queued requests beyond which new ones are refused
    compile: bool | None = None  # decode steps through torch.compile (CUDA graphs on CUDA); None: on for CUDA, TP 1


@dataclass
class StepOutput:
    request_id: int
    new_ids: list[int]  # tokens this step added (none when it ended on end-of-document)
    text: str  # text this step added (a stream's delta)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end-of-document or a stop string), "length", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device):
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        m = loaded.config.model
        # learned positions end there; a RoPE model was trained to it
        self.context_length = m.max_position_embeddings or m.seq_length
        tp = loaded.topology.tp
        compiled = device.type == "cuda" and tp == 1 if config.compile is None else config.compile
        if compiled and tp > 1:
            raise MtlError(f"--compile runs with --tp 1 only (asked for --tp {tp}); pass --no-compile")
        groups, head_dim = m.num_query_groups // tp, m.head_dim
        dtype = next(loaded.model.parameters()).dtype
        per_block = KVPool.bytes_per_block(m.num_layers, config.block_size, groups, head_dim, dtype)
        num_blocks = kv_budget_bytes(config.kv_memory, device) // per_block - 1  # one more: the scratch block
        self.blocks = BlockManager(num_blocks, config.block_size)
        if num_blocks < self.blocks.blocks_for(self.context_length):
            raise MtlError(f"--kv-memory {config.kv_memory} holds {num_blocks} blocks of {config.block_size} tokens "
                           f"({per_block} bytes each), fewer than one full context of {self.context_length} "
                           "tokens needs; give more")
        pool = KVPool(m.num_layers, num_blocks + 1, config.block_size, groups, head_dim, dtype, device)
        decode = DecodeStep(loaded.model, pool, config.block_size, self.blocks.blocks_for(self.context_length),
                            scratch_block=num_blocks, device=device, compile=compiled, max_batch=config.max_batch)
        self.runner = ModelRunner(loaded.model, loaded.topology, pool, config.block_size, device, decode)
        self.scheduler = Scheduler(self.blocks, max_batch=config.max_batch, max_step_tokens=config.max_step_tokens,
                                   max_waiting=config.max_waiting)
        self.device = device
        self._ids = itertools.count()
        self._sequences: dict[int, Sequence] = {}

    @property
    def has_work(self) -> bool:
        return bool(self._sequences)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, or a RequestError naming the field at fault."""
        try:
            params.check()
        except MtlError as exc:
            raise RequestError(str(exc), str(exc).split(" ")[0].rstrip(":")) from None
        if not prompt_ids:
            raise RequestError("prompt: it encodes to no tokens; give a non-empty prompt", "prompt")
        if any(not 0 <= t < self.loaded.config.model.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt: token ids must be in [0, {self.loaded.config.model.vocab_size})", "prompt")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise RequestError(f"prompt: {len(prompt_ids)} tokens leave no room in the model's context of "
                               f"{self.context_length} tokens; shorten it", "prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(f"max_tokens: {len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} "
                               f"exceed the model's context of {self.context_length} tokens", "max_tokens")
        max_tokens = params.max_tokens or room
        if self.blocks.blocks_for(len(prompt_ids) + max_tokens) > self.blocks.num_blocks:
            raise RequestError(f"max_tokens: the request could need more KV blocks than the pool holds "
                               f"({self.blocks.num_blocks}); lower max_tokens", "max_tokens")
        return max_tokens

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue a request (under ``request_id`` when given); its id. RequestError for a bad
        one, QueueFull when full."""
        max_tokens = self.check(prompt_ids, params)
        if self.scheduler.queue_full():
            raise QueueFull(f"the queue holds {self.config.max_waiting} waiting requests; retry later")
        seq = Sequence(next(self._ids) if request_id is None else request_id, list(prompt_ids), params, max_tokens,
                       make_generator(params.seed, self.device),
                       TextStream(self.tokenizer, prompt_ids, params.stop) if params.detokenize else None)
        self._sequences[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is; its blocks return to the pool now."""
        seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)

    def step(self) -> list[StepOutput]:
        chosen = self.scheduler.schedule()
        if not chosen:
            return []
        plan, sampled = self._plan(chosen)
        logits = self.runner.execute(plan)
        tokens, logprobs = sample_rows(logits, [s.params for s in sampled], [s.generator for s in sampled])
        return [self._advance(seq, token, lp) for seq, token, lp in zip(sampled, tokens, logprobs)]

    def _plan(self, chosen: list[tuple[Sequence, int]]) -> tuple[StepPlan, list[Sequence]]:
        ids, starts, lengths, tables, rows, sampled = [], [], [], [], [], []
        for seq, count in chosen:
            ids += seq.pending_ids(count)
            starts.append(seq.cached)
            lengths.append(count)
            tables.append(list(self.blocks.grow(seq.id, seq.cached + count)))
            seq.cached += count
            if not seq.prefilling:  # its last pending token: the next one is sampled from it
                rows.append(len(ids) - 1)
                sampled.append(seq)
        return StepPlan(ids, starts, lengths, tables, rows), sampled

    def _advance(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        new_ids: list[int] = []
        if token == self.tokenizer.eod and not seq.params.ignore_eos:
            seq.finish_reason = "stop"  # like `mtl generate`, the end-of-document token is not part of the text
        else:
            new_ids = [token]
            seq.output_ids.append(token)
            seq.logprobs.append(logprobs)
            if len(seq.output_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
        if seq.text is not None:
            seq.text.update(new_ids, final=seq.finish_reason is not None)
            if seq.text.stopped:
                seq.finish_reason = "stop"  # a stop string, even in the last token's text
        if seq.finish_reason is not None:
            self.abort(seq.id)
        text = seq.text.delta(final=seq.finish_reason is not None) if seq.text is not None else ""
        return StepOutput(seq.id, new_ids, text,
                          [logprobs] if new_ids else [], seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids))

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self.scheduler.waiting) + len(self.scheduler.requeued), "running": len(self.scheduler.running),
                "kv_blocks_in_use": self.blocks.blocks_in_use, "kv_blocks_total": self.blocks.num_blocks}

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], progress=None) -> list[list[StepOutput]]:
        """Every prompt to its end (offline batches): each request's step outputs, in order.
        ``progress(n)`` is called with the number of requests each step finished."""
        for prompt_ids, p in zip(prompts, params):
            self.check(prompt_ids, p)  # every request before any compute
        pending = list(zip(prompts, params))
        outputs: dict[int, list[StepOutput]] = {}
        order: list[int] = []
        while pending or self.has_work:
            while pending and not self.scheduler.queue_full():
                rid = self.add(*pending.pop(0))
                outputs[rid] = []
                order.append(rid)
            finished = 0
            for out in self.step():
                outputs[out.request_id].append(out)
                finished += out.finish_reason is not None
            if progress is not None and finished:
                progress(finished)
        return [outputs[rid] for rid in order]
