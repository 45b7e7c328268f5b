"""OpenAI response bodies: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from mtl.serve.engine import StepOutput
from mtl.serve.sampling import TokenLogprobs


@dataclass
class ChoiceState:
    """What one choice has gathered from the engine's outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0

    def add(self, out: StepOutput) -> None:
        self.text += out.text
        self.token_ids += out.new_ids
        self.logprobs += [lp for lp in out.logprobs if lp is not None]
        self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens


class ResponseWriter:
    """The bodies of one HTTP request's response (one id and creation time for all its chunks)."""

    def __init__(self, kind: str, model: str, tokenizer):
        self.kind = kind  # "completion" or "chat"
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = "text_completion" if self.kind == "completion" else \
            ("chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs(self, entries: list[TokenLogprobs], ids: list[int]) -> dict:
        if self.kind == "completion":  # the legacy layout
            tokens = [self._token(i) for i in ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                    "top_logprobs": [{self._token(t): lp for t, lp in e.top.items()} for e in entries],
                    "text_offset": offsets}
        return {"content": [{"token": self._token(i), "logprob": e.logprob,
                             "bytes": list(self._token(i).encode("utf-8")),
                             "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                               "bytes": list(self._token(t).encode("utf-8"))}
                                              for t, lp in e.top.items()]}
                            for i, e in zip(ids, entries)]}

    def _choice(self, index: int, text: str, ids: list[int], entries: list[TokenLogprobs] | None,
                finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
        logprobs = self.logprobs(entries, ids) if entries is not None else None
        if self.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    @staticmethod
    def usage(choices: list[ChoiceState], prompt_tokens: int) -> dict:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def whole(self, choices: list[ChoiceState], with_logprobs: bool, prompt_tokens: int) -> dict:
        return {**self._envelope(chunk=False),
                "choices": [self._choice(c.index, c.text, c.token_ids, c.logprobs if with_logprobs else None,
                                         c.finish_reason, chunk=False) for c in choices],
                "usage": self.usage(choices, prompt_tokens)}

    def chunk(self, index: int, out: StepOutput, with_logprobs: bool, first: bool) -> dict:
        entries = [lp for lp in out.logprobs if lp is not None] if with_logprobs else None
        return {**self._envelope(chunk=True),
                "choices": [self._choice(index, out.text, out.new_ids, entries, out.finish_reason, chunk=True,
                                         first=first)]}

    def usage_chunk(self, choices: list[ChoiceState], prompt_tokens: int) -> dict:
        return {**self._envelope(chunk=True), "choices": [], "usage": self.usage(choices, prompt_tokens)}
