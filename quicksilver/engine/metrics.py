"""Prometheus metrics for the engine and the HTTP layer, in a registry per app (tests never collide)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPF_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, window_s: float = 10.0):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("quicksilver_requests", "Requests by outcome", ["outcome"], registry=r)
        self.queue_depth = Gauge("quicksilver_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("quicksilver_running_requests", "Requests being decoded", registry=r)
        self.generated_tokens = Counter("quicksilver_generated_tokens", "Answer tokens returned", registry=r)
        self.prompt_tokens = Counter("quicksilver_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "quicksilver_cached_prompt_tokens", "Prompt tokens read from the prefix cache instead of computed",
            registry=r,
        )
        self.forwards = Counter("quicksilver_forwards", "Batched model forwards", registry=r)
        self.throughput = Gauge(
            "quicksilver_tokens_per_second", f"Tokens committed per second over the last {window_s:g} s", registry=r
        )
        self.tokens_per_forward = Histogram(
            "quicksilver_request_tokens_per_forward", "Answer tokens per decoding forward, per request",
            buckets=TPF_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "quicksilver_batch_size", "Requests per forward", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.step_seconds = Histogram("quicksilver_step_seconds", "Wall time of one batched step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("quicksilver_request_latency_seconds", "Submit to finish",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("quicksilver_time_to_first_token_seconds", "Submit to first streamable token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("quicksilver_queue_wait_seconds", "Submit to admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter("quicksilver_http_requests", "HTTP requests", ["route", "status"], registry=r)
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()

    def record_step(self, batch: int, seconds: float, committed: int) -> None:
        self.forwards.inc()
        self.batch_size.observe(batch)
        self.step_seconds.observe(seconds)
        now = time.monotonic()
        self._recent.append((now, committed))
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()
        span = max(now - self._recent[0][0], seconds, 1e-9)
        self.throughput.set(sum(n for _, n in self._recent) / span)
