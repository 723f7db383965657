"""``POST /v1/completions`` (legacy text completions): one or more prompts, ``suffix`` for fill-in-the-middle,
``echo``, ``logprobs`` (streamed: one chunk per choice once its answer is whole), and ``max_tokens: 0`` to score
a prompt without generating.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from quicksilver.api.dispatch import (
    SSE_HEADERS,
    check_logprobs,
    merged,
    results_or_disconnect,
    score,
    sse,
    submit_all,
    usage,
)
from quicksilver.api.errors import APIError
from quicksilver.api.logprobs import completion_logprobs
from quicksilver.api.params import build_params, check_stream_options, prompt_too_long
from quicksilver.api.protocol import CompletionRequest
from quicksilver.api.state import ServerState
from quicksilver.decoding import GenerationResult
from quicksilver.engine import RequestHandle, TextStreamer
from quicksilver.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """[(prompt ids, echo text)] for each prompt; with ``suffix``, a fill-in-the-middle prompt."""
    tok = state.tokenizer
    raw = req.prompt
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in items:
        ids = tok.encode(item) if isinstance(item, str) else list(item)
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise APIError(400, "prompt contains token ids outside the vocabulary", param="prompt")
        echo = item if isinstance(item, str) else tok.decode(ids)
        if req.suffix is not None:
            fim = [tok.token_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)]
            if any(i is None for i in fim):
                raise APIError(400, "this model has no fill-in-the-middle tokens; suffix is not supported",
                               param="suffix")
            ids = [fim[0], *ids, fim[1], *tok.encode(req.suffix), fim[2]]
        if not ids:  # unconditional text, as OpenAI allows: start from the end-of-text token, as GPT-2 does
            ids = [tok.eos_id]
        out.append((ids, echo))
    return out


async def completion(state: ServerState, req: CompletionRequest, request: Request):
    """The reply body for ``req`` (n choices per prompt), or a stream of chunks."""
    engine = state.engine
    state.check_model(req.model)
    check_stream_options(req)
    if req.logprobs is not None:
        check_logprobs(state, "logprobs")
        if req.echo and req.suffix is not None:
            raise APIError(400, "logprobs of an echoed fill-in-the-middle prompt are not supported",
                           param="logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    prompts = completion_prompts(state, req)
    if req.max_tokens == 0:  # score the prompts only (echo + logprobs), as OpenAI's legacy endpoint allowed
        return await score_prompts(state, req, prompts)
    longest = max(len(ids) for ids, _ in prompts)
    params = build_params(req, engine.loaded.defaults, longest, engine.context_length, req.max_tokens,
                          state.tokenizer.vocab_size, prompt_param="prompt")
    handles = submit_all(engine, [ids for ids, _ in prompts], params, req.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    echoes = [echo if req.echo else "" for _, echo in prompts for _ in range(req.n)]
    if req.stream:
        gen = stream_completion(state, handles, rid, created, req, prompts, echoes, prompt_tokens)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await results_or_disconnect(request, handles)
    choices = [{"index": i, "text": echoes[i] + r.text, "logprobs": None, "finish_reason": r.finish_reason}
               for i, r in enumerate(results)]
    if req.logprobs is not None:
        for i, r in enumerate(results):
            choices[i]["logprobs"] = await answer_logprobs(state, req, prompts[i // req.n][0], r)
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "system_fingerprint": state.fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, results, req.n)}


async def answer_logprobs(state: ServerState, req: CompletionRequest, ids: list[int],
                          result: GenerationResult) -> dict[str, Any]:
    """Legacy ``logprobs`` of one choice: its answer's tokens, after the echoed prompt's when ``echo`` is set."""
    assert req.logprobs is not None
    start = 1 if req.echo else len(ids)  # the echoed prompt's tokens are scored too
    scored = await score(state, ids, result.token_ids, start, req.logprobs)
    cut = len(ids) - start
    return completion_logprobs(state.lexicon, ids if req.echo else None, scored[:cut], scored[cut:], result.text,
                               req.logprobs > 0)


async def score_prompts(state: ServerState, req: CompletionRequest, prompts: list[tuple[list[int], str]]) -> dict:
    """``max_tokens: 0``: no generation; each prompt echoed (when asked) with its tokens' log-probabilities."""
    if req.stream:
        raise APIError(400, "max_tokens 0 is not supported with stream: true", param="max_tokens")
    if req.suffix is not None:
        raise APIError(400, "max_tokens 0 is not supported with suffix", param="max_tokens")
    choices = []
    for ids, echo in prompts:
        if len(ids) > state.engine.context_length:
            raise prompt_too_long(state.engine.context_length, len(ids), "prompt")
        logprobs = None
        if req.logprobs is not None and req.echo:
            scored = await score(state, ids, [], 1, req.logprobs)
            logprobs = completion_logprobs(state.lexicon, ids, scored, [], "", req.logprobs > 0)
        for _ in range(req.n):
            choices.append({"index": len(choices), "text": echo if req.echo else "", "logprobs": logprobs,
                            "finish_reason": "length"})
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "system_fingerprint": state.fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


async def stream_completion(
    state: ServerState, handles: list[RequestHandle], rid: str, created: int, req: CompletionRequest,
    prompts: list[tuple[list[int], str]], echoes: list[str], prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    streamers = [TextStreamer(state.tokenizer, stops) for _ in handles]
    results: list[GenerationResult | None] = [None] * len(handles)  # in handle order: n choices per prompt

    def chunk(i: int, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                "system_fingerprint": state.fingerprint,
                                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
        async for i, u in merged(handles):
            if u.error is not None:
                yield sse(APIError(500, f"decoding failed: {u.error}", "server_error", code="server_error").body())
                return
            if u.result is None:
                delta = streamers[i].push(u.committed_ids)
                if delta:
                    yield chunk(i, delta)
                continue
            results[i] = u.result
            rest = streamers[i].finish(u.result.text)
            if req.logprobs is not None:  # known once the answer is whole: one chunk carries them (the text before it)
                if rest:
                    yield chunk(i, rest)
                    rest = ""
                yield chunk(i, "", logprobs=await answer_logprobs(state, req, prompts[i // req.n][0], u.result))
            yield chunk(i, rest, u.result.finish_reason)
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                        "system_fingerprint": state.fingerprint, "choices": [],
                        "usage": usage(prompt_tokens, [r for r in results if r is not None], req.n)})
        yield "data: [DONE]\n\n"
    finally:
        for h in handles:
            h.cancel()
