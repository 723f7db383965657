"""Concurrency sweep through the serving engine: N closed-loop clients, each sending requests back to back.

With N clients there are always N requests in the engine (continuous batching refills a slot as soon as
a request finishes), which is what "N simultaneous requests" means for a server. Aggregate throughput is
all useful tokens over the wall time of the level; latency is per request, submit to final result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from quicksilver.bench.workload import Prompt, percentile
from quicksilver.checkpoint import LoadedModel
from quicksilver.sampling import SamplingParams


def _forwards(engine) -> float:
    return engine.metrics.registry.get_sample_value("quicksilver_forwards_total") or 0.0


async def _level(loaded: LoadedModel, params: SamplingParams, prompts: Sequence[Prompt], clients: int,
                 per_client: int, batch_invariant: bool) -> dict:
    from quicksilver.engine import Engine

    engine = Engine(loaded, max_batch=clients, max_queue=clients, batch_invariant=batch_invariant)
    await engine.start()
    latencies: list[float] = []
    tokens = 0
    forwards_before = _forwards(engine)

    async def client(c: int) -> None:
        nonlocal tokens
        for j in range(per_client):
            p = prompts[(c * per_client + j) % len(prompts)]
            t0 = time.perf_counter()
            handle = engine.submit(p.ids, params.replace(max_tokens=p.max_tokens))
            result = await handle.result()
            latencies.append(time.perf_counter() - t0)
            tokens += result.stats.tokens

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(c) for c in range(clients)))
    finally:
        await engine.shutdown(drain=True)
    wall = time.perf_counter() - t0
    steps = _forwards(engine) - forwards_before
    return {
        "concurrency": clients, "requests": len(latencies), "useful_tokens": tokens, "wall_s": wall,
        "batched_forwards": int(steps),
        "aggregate_tokens_per_second": tokens / wall if wall else 0.0,
        "latency_s_p50": percentile(latencies, 50), "latency_s_p99": percentile(latencies, 99),
    }


def concurrency_sweep(
    loaded: LoadedModel,
    params: SamplingParams,
    prompts: Sequence[Prompt],
    levels: Sequence[int],
    requests_per_level: int,
    batch_invariant: bool = True,
) -> list[dict]:
    """One engine per level; each level serves at least ``requests_per_level`` requests (and at least one
    per client), cycling through ``prompts``."""
    out = []
    for n in levels:
        per_client = max(1, -(-requests_per_level // n))
        out.append(asyncio.run(_level(loaded, params, prompts, n, per_client, batch_invariant)))
    return out


def with_model(loaded: LoadedModel, model) -> LoadedModel:
    """The same loaded model (tokenizer, defaults, name) around a prepared copy of its weights."""
    return dataclasses.replace(loaded, model=model)
