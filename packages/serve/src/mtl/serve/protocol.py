"""The OpenAI request bodies the server accepts (pydantic) and the sampling they ask for.

Fields the server does not use are ignored, as OpenAI's own API ignores unknown ones; ``top_k``
and ``ignore_eos`` are the extensions vLLM also accepts (the ``openai`` client sends them
through ``extra_body``)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, Field

from mtl.serve.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def sampling(self, max_tokens: int | None, logprobs: int | None, copy: int) -> SamplingParams:
        """The engine's parameters for the ``copy``-th of the ``n`` choices (a seeded request
        gives each choice its own seed)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else self.seed + copy
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed, stop=stop, logprobs=logprobs, ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: Union[str, list[TextPart], None] = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text or ""}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: what the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
