"""The bridge from a request to the engine: submitting choices, waiting for or merging their results, scoring
tokens on the model thread, and the pieces of the reply every route shares (usage, server-sent events)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from quicksilver.api.errors import APIError
from quicksilver.api.state import ServerState
from quicksilver.decoding import GenerationResult
from quicksilver.engine import Engine, EngineClosed, EngineError, EngineOverloaded, RequestHandle, StepUpdate
from quicksilver.sampling import SamplingParams


def check_logprobs(state: ServerState, param: str) -> None:
    from quicksilver.decoding.scoring import supports_logprobs

    if not supports_logprobs(state.engine.loaded.model.config):
        raise APIError(400, "this model has no left-to-right distribution to report logprobs from (a "
                            "bidirectional diffusion model)", param=param)


async def score(state: ServerState, prompt_ids: Sequence[int], answer_ids: Sequence[int], start: int,
                 top: int | None) -> list:
    """Token log-probabilities of prompt + answer from ``start`` on (slot fillers left out), on the model thread."""
    from quicksilver.decoding.scoring import token_logprobs

    filler = state.lexicon.filler_id
    ids = [*prompt_ids, *(t for t in answer_ids if t != filler)]
    return await state.engine.run_in_worker(token_logprobs, state.engine.loaded.model, ids, start, top or 0)


def check_capacity(engine: Engine, prompts: int, n: int) -> None:
    """APIError 400 if ``prompts`` x ``n`` completions are more than the server ever holds at once (a retry, which
    a 429 asks for, could not succeed). Checked before any work for the request (e.g. building its constraints)."""
    total, capacity = prompts * n, engine.max_batch + engine.max_queue
    if total > capacity:
        asked = f"{prompts} prompt{'s' * (prompts != 1)} x n={n}"
        raise APIError(400, f"this request asks for {total} completions ({asked}) but the server holds at most "
                            f"{capacity} at a time", param="n" if prompts == 1 else "prompt")


def submit_all(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
    constraint_for=None, snapshots: bool = False,
) -> list[RequestHandle]:
    """Submit n choices per prompt (seed + i per choice); all-or-nothing."""
    check_capacity(engine, len(prompts), n)
    handles: list[RequestHandle] = []
    try:
        for ids in prompts:
            for i in range(n):
                p = params if params.seed is None or i == 0 else params.replace(seed=choice_seed(params.seed, i))
                constraint = constraint_for() if constraint_for else None
                handles.append(engine.submit(ids, p, constraint, snapshots=snapshots))
    except BaseException as exc:
        for h in handles:
            h.cancel()
        if isinstance(exc, EngineOverloaded):
            raise APIError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        if isinstance(exc, EngineClosed):
            raise APIError(503, str(exc), "server_error", code="service_unavailable") from None
        if isinstance(exc, ValueError):
            code = "context_length_exceeded" if "context" in str(exc) else None
            raise APIError(400, str(exc), code=code) from None
        raise
    return handles


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StepUpdate]]:
    """Updates of several handles as (choice index, update), in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        async for u in h:
            await queue.put((i, u))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            i, u = await queue.get()
            if u.final:
                remaining -= 1
            yield i, u
    finally:
        for t in tasks:
            t.cancel()


async def results_or_disconnect(request: Request, handles: list[RequestHandle]) -> list[GenerationResult]:
    """Wait for all results; if the client goes away first, free the slots."""
    gathered = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.25)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    except EngineError as exc:
        raise APIError(500, f"decoding failed: {exc}", "server_error", code="server_error") from None
    finally:
        if not gathered.done():
            gathered.cancel()
        for h in handles:
            h.cancel()


def usage(prompt_tokens: int, results: Sequence[GenerationResult], choices_per_prompt: int = 1) -> dict[str, Any]:
    """OpenAI usage for ``results``: ``choices_per_prompt`` consecutive results per prompt, each prompt counted
    once in ``prompt_tokens`` (and so in the cached tokens: the most any of its choices read from the cache)."""
    completion = sum(r.stats.tokens for r in results)
    k = max(1, choices_per_prompt)
    cached = sum(max(r.stats.cached_tokens for r in results[i : i + k]) for i in range(0, len(results), k))
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed for a request seeded ``seed``: ``seed + i``, wrapped around within signed 64 bits (any
    seed the API accepts, up to 2**63 - 1, still gives n distinct valid seeds)."""
    return (seed + i + 2**63) % 2**64 - 2**63
