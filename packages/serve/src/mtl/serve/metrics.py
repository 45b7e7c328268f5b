"""Prometheus metrics of the server, in a registry of its own (``/metrics``)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mtl_serve_requests",
                                "HTTP requests answered, by route ('unmatched': any other path) and status",
                                ["path", "status"], registry=r)
        self.queue = Gauge("mtl_serve_queue_length", "requests waiting to join the batch", registry=r)
        self.running = Gauge("mtl_serve_running_requests", "requests in the running batch", registry=r)
        self.blocks_in_use = Gauge("mtl_serve_kv_blocks_in_use", "KV-cache blocks holding tokens", registry=r)
        self.blocks_total = Gauge("mtl_serve_kv_blocks_total", "KV-cache blocks in the pool", registry=r)
        self.prompt_tokens = Counter("mtl_serve_prompt_tokens", "prompt tokens read", registry=r)
        self.generated_tokens = Counter("mtl_serve_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_second = Gauge("mtl_serve_tokens_per_second",
                                       "generated tokens per second over the last second of work", registry=r)
        self.time_to_first_token = Histogram("mtl_serve_time_to_first_token_seconds",
                                              "from a request's arrival to its first token", registry=r)
        self._window_start, self._window_tokens = time.monotonic(), 0

    def engine_state(self, stats: dict[str, int], new_tokens: int) -> None:
        """After each step (and when idle): gauges from the engine, the tokens/s window."""
        self.queue.set(stats["waiting"])
        self.running.set(stats["running"])
        self.blocks_in_use.set(stats["kv_blocks_in_use"])
        self.blocks_total.set(stats["kv_blocks_total"])
        self.generated_tokens.inc(new_tokens)
        self._window_tokens += new_tokens
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self.tokens_per_second.set(self._window_tokens / (now - self._window_start))
            self._window_start, self._window_tokens = now, 0
