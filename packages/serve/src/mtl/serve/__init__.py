"""mtl's inference engine and OpenAI-compatible server (``mtl serve``).

The engine (``engine.py``) runs any gpt-family checkpoint over a paged KV cache
(``kv_cache.py``, ``paged_attention.py``) with continuous batching (``scheduler.py``) and
per-request sampling (``sampling.py``); ``server.py`` puts the OpenAI HTTP API in front of it."""

from mtl.serve.engine import Engine, EngineConfig
from mtl.serve.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams"]
