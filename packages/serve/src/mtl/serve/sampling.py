"""Per-request sampling: temperature, top-k, top-p, a seed of its own, and log-probabilities.

Each request draws from its own ``torch.Generator``, so its tokens do not depend on which other
requests share the step; with ``top_p = 1`` a request samples exactly as ``mtl generate`` does
(the same operations on the same generator), and temperature 0 is greedy."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from mtl.core.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this much probability
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely
    ignore_eos: bool = False  # keep going past the end-of-document token (benchmarks)
    detokenize: bool = True  # False: token ids only, no text (rollouts, benchmarks; no stop strings)

    def check(self) -> None:
        """A ConfigError naming the first field out of range (the server answers 400 with it)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens = {self.max_tokens} must be at least 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature = {self.temperature} must not be negative")
        if self.top_k < 0:
            raise ConfigError(f"top_k = {self.top_k} must not be negative (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ConfigError(f"logprobs = {self.logprobs} must be between 0 and 20")
        if self.stop and not self.detokenize:
            raise ConfigError("stop: stop strings need the text; leave detokenize on")
        if any(not s for s in self.stop):
            raise ConfigError("stop: an empty string would end every text at once")


@dataclass
class TokenLogprobs:
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(random.getrandbits(63) if seed is None else seed)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits [V] (fp32, true vocabulary only)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_largest = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        before = torch.cumsum(torch.softmax(ordered, -1), -1) - torch.softmax(ordered, -1)  # mass ahead of each
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(0, order, before >= params.top_p)
        logits = logits.masked_fill(drop, float("-inf"))  # the most likely token always stays (0 ahead of it)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def rows_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Each row's chosen token's log-probability under the model's distribution, and its ``top``
    most likely tokens: one log-softmax and one top-k over all the rows, one copy to the host."""
    logp = torch.log_softmax(logits, dim=-1)  # [R, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))[:, 0].tolist()
    best = torch.topk(logp, max(tops), dim=-1) if max(tops) else None
    values, indices = (best.values.tolist(), best.indices.tolist()) if best is not None else ([], [])
    return [TokenLogprobs(chosen[r], {indices[r][i]: values[r][i] for i in range(top)}) for r, top in enumerate(tops)]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens (and log-probabilities where asked) for every row of logits [R, V]: greedy rows in
    one argmax, the rest one by one with each request's generator, the log-probabilities of all
    the rows that ask for them together."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature != 0:
            tokens[row] = sample_row(logits[row], p, gen)
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    asked = [row for row, p in enumerate(params) if p.logprobs is not None]
    if asked:
        found = rows_logprobs(logits[asked], [tokens[r] for r in asked], [params[r].logprobs for r in asked])
        for row, entry in zip(asked, found):
            logprobs[row] = entry
    return tokens, logprobs
