"""Concurrency sweep through the serving engine: N closed-loop clients, each sending requests back to back.

With N clients there are always N requests in the engine (continuous batching refills a slot as soon as
a request finishes), which is what "N simultaneous requests" means for a server. Clients take their next
prompt from one shared pool, like independent users, until it is empty.

Two throughputs per level:

* ``aggregate_tokens_per_second``: all useful tokens over the wall time of the whole level, the drain at the
  end included (when the pool is empty, the batch shrinks as the last requests finish one by one);
* ``sustained_tokens_per_second``: useful tokens committed while all N clients were busy (from the start until
  the pool ran dry) over that window. Requests still running at the window's end count the answer tokens they
  had committed by then. This is the rate at N concurrent streams; with few requests per client the whole-level
  number mostly measures the drain.

Latency is per request, submit to final result.

The engine's steps run inline, on the thread that runs the whole benchmark (``InlineExecutor``): one thread does
all the torch work, as in ``quicksilver serve`` (``quicksilver.engine.model_thread``). A second thread running
forwards would slow every forward (docs/performance.md section 8). Blocking the event loop during a step costs
nothing here: the clients are coroutines on the same loop, and they submit between steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, Future

from quicksilver.bench.workload import Prompt, percentile
from quicksilver.checkpoint import LoadedModel
from quicksilver.sampling import SamplingParams


class InlineExecutor(Executor):
    """Runs each submitted call at once on the calling thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(exc)
        return future


def _sample(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


async def _level(loaded: LoadedModel, params: SamplingParams, prompts: Sequence[Prompt], clients: int,
                 requests: int) -> dict:
    from quicksilver.engine import Engine

    engine = Engine(loaded, max_batch=clients, max_queue=clients, worker=InlineExecutor())
    await engine.start()
    pool = deque(prompts[i % len(prompts)] for i in range(requests))
    latencies: list[float] = []
    tokens = 0
    in_window = 0  # useful tokens of requests finished while every client was busy
    window_end: float | None = None
    running: dict[int, object] = {}  # client -> its current request handle
    forwards_before = _sample(engine, "quicksilver_forwards_total")
    batch_before = _sample(engine, "quicksilver_batch_size_sum")

    async def client(c: int) -> None:
        nonlocal tokens, in_window, window_end
        while pool:
            p = pool.popleft()
            t_submit = time.perf_counter()
            handle = engine.submit(p.ids, params.replace(max_tokens=p.max_tokens))
            running[c] = handle
            result = await handle.result()
            latencies.append(time.perf_counter() - t_submit)
            tokens += result.stats.tokens
            if window_end is None:
                in_window += result.stats.tokens
        running.pop(c, None)
        if window_end is None:  # the first client out of work closes the full-occupancy window
            window_end = time.perf_counter()
            in_window += sum(h.state.committed_prefix_len for h in running.values() if not h.done)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in range(clients)))
    finally:
        await engine.shutdown(drain=True)
    wall = time.perf_counter() - t0
    window = (window_end or t0 + wall) - t0
    steps = _sample(engine, "quicksilver_forwards_total") - forwards_before
    batch_sum = _sample(engine, "quicksilver_batch_size_sum") - batch_before
    return {
        "concurrency": clients, "requests": len(latencies), "useful_tokens": tokens, "wall_s": wall,
        "batched_forwards": int(steps), "mean_batch": batch_sum / steps if steps else 0.0,
        "aggregate_tokens_per_second": tokens / wall if wall else 0.0,
        "sustained_window_s": window,
        "sustained_tokens_per_second": in_window / window if window > 0 else 0.0,
        "latency_s_p50": percentile(latencies, 50), "latency_s_p99": percentile(latencies, 99),
    }


def concurrency_sweep(
    loaded: LoadedModel,
    params: SamplingParams,
    prompts: Sequence[Prompt],
    levels: Sequence[int],
    requests_per_level: int,
    min_requests_per_client: int = 10,
) -> list[dict]:
    """One engine per level. Every level serves the same requests, so their rates compare like with like:
    ``requests_per_level`` of them, but at least ``min_requests_per_client`` per client of the busiest level (so
    the engine runs full for a while before the drain; with 3, a 32-client level lasted about a second and its
    ratio to one stream ranged 1.19-2.14x in session 42), cycling through ``prompts``."""
    requests = max(requests_per_level, max(levels, default=1) * max(1, min_requests_per_client))
    return [asyncio.run(_level(loaded, params, prompts, n, requests)) for n in levels]


def with_model(loaded: LoadedModel, model) -> LoadedModel:
    """The same loaded model (tokenizer, defaults, name) around a prepared copy of its weights."""
    return dataclasses.replace(loaded, model=model)
