"""The built-in ``search_documents`` tool (``"retrieval": {"mode": "tool"}``, see docs/rag.md): decode; while the
answer calls the tool and the search budget allows, run the search here, add the call and its passages to the
conversation, and decode again. The reply lists the sources given to the model and every search made.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from quicksilver.api.chat import ChatPlan, assistant_message
from quicksilver.api.dispatch import SSE_HEADERS, results_or_disconnect, sse, submit_all, usage
from quicksilver.api.errors import APIError
from quicksilver.api.params import build_params
from quicksilver.api.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from quicksilver.api.state import ServerState
from quicksilver.decoding import GenerationResult


def _search_tool(state: ServerState, req: ChatCompletionRequest) -> Tool:
    """The built-in tool as a request Tool, after checking that this request may use it."""
    if state.index_path is None:
        raise APIError(400, "retrieval not available: the server was started without --index", param="retrieval")
    try:
        from quicksilver.rag.chat import SEARCH_TOOL
    except ImportError:
        raise APIError(400, "retrieval not available in this build", param="retrieval") from None
    name = SEARCH_TOOL["function"]["name"]
    if any(t.function.name == name for t in req.tools or []):
        raise APIError(400, f'a client tool may not be named {name!r} with retrieval mode "tool": the server runs '
                            "its built-in tool of that name", param="tools")
    if req.n != 1:  # each choice could search differently; one conversation per request keeps the rounds simple
        raise APIError(400, 'retrieval mode "tool" supports only n=1', param="n")
    if req.diffusing:
        raise APIError(400, 'diffusing is not supported with retrieval mode "tool"', param="diffusing")
    return Tool.model_validate(SEARCH_TOOL)


def _tool_choice_after_search(choice: Any, client_tools: list[Tool], search_name: str) -> Any:
    """A tool_choice that only search_documents can satisfy applies to the first round; once the server has
    searched, the model may answer (otherwise it would be forced to search until the budget is spent)."""
    if isinstance(choice, NamedToolChoice) and choice.function.name == search_name:
        return "auto"
    if choice == "required" and not client_tools:
        return "auto"
    return choice


def _round_tools(
    client_tools: list[Tool], search: Tool, choice: Any, rounds_done: int, budget: int
) -> tuple[list[Tool], Any]:
    """(tools the model sees, tool_choice) for the next decoding round."""
    name = search.function.name
    if rounds_done < budget:
        return [*client_tools, search], (choice if rounds_done == 0 else
                                          _tool_choice_after_search(choice, client_tools, name))
    # search budget spent: the built-in tool is withdrawn, so the model answers or calls a client tool
    if not client_tools:
        return [], "none"
    if isinstance(choice, NamedToolChoice) and choice.function.name == name:
        choice = "auto"
    return client_tools, choice


async def _run_search(state: ServerState, arguments: dict[str, Any], k: int, first_id: int):
    """(error observation or None, sources). A bad call (e.g. a blank query) becomes an ``error:`` observation the
    model can react to; an unreadable index is the request's failure."""
    from quicksilver.rag.chat import run_search_tool

    try:
        _, found = await state.engine.run_in_worker(run_search_tool, state.index_path, arguments, k, first_id)
    except (OSError, LookupError) as exc:
        raise APIError(400, f"retrieval failed: {exc}", param="retrieval") from None
    except ValueError as exc:
        return f"error: {exc}", []
    return None, found


def _observations(found: list[tuple[str | None, list[dict[str, Any]]]], keep: int) -> list[dict[str, Any]]:
    """One tool message per search call, giving the model only the first ``keep`` passages overall."""
    from quicksilver.rag.chat import format_sources

    out = []
    for error, sources in found:
        given = sources[: max(keep, 0)]
        keep -= len(given)
        if error is not None:
            text = error
        elif not sources:
            text = "No matching passages."
        elif not given:
            text = "The passages found do not fit in the context."
        else:
            text = format_sources(given)
        out.append({"role": "tool", "content": text})
    return out


def _summed_stats(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Diffusion stats of all rounds added up (rates recomputed); time to first token counts from the start of
    the first round to the first committed token of the final answer, searches included."""
    stats = [r.stats for r in results]
    tokens, steps = sum(s.tokens for s in stats), sum(s.steps for s in stats)
    wall = sum(s.wall_time for s in stats)
    last, first = stats[-1], stats[0]
    return {
        "tokens": tokens, "forwards": sum(s.forwards for s in stats),
        "prefill_forwards": sum(s.prefill_forwards for s in stats), "steps": steps,
        "committed": sum(s.committed for s in stats), "remasked": sum(s.remasked for s in stats),
        "tokens_per_forward": round(tokens / steps if steps else 0.0, 4),
        "wall_time_s": round(wall, 6), "tokens_per_second": round(tokens / wall if wall else 0.0, 3),
        "time_to_first_token_s": None if last.first_token_time is None
        else round(last.first_token_time - first.started, 6),
        "rounds": len(results),
    }


async def chat_with_search_tool(
    state: ServerState, req: ChatCompletionRequest, request: Request, messages: list[dict[str, Any]]
):
    """Decode; while the answer is a call to the built-in search_documents (and the budget allows), run the search,
    append the call and its observation to the conversation, and decode again."""
    search = _search_tool(state, req)
    name = search.function.name
    engine = state.engine
    retrieval = req.retrieval
    client_tools = list(req.tools or [])
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # room the answer needs; passages that would crowd it out are not given to the model
    answer_room = max_tokens if max_tokens is not None else min(engine.loaded.defaults.max_tokens,
                                                                engine.context_length // 4)
    sources: list[dict[str, Any]] = []
    searches: list[dict[str, Any]] = []
    results: list[GenerationResult] = []
    prompt_tokens = 0
    rounds_done = 0

    def plan_for(conversation: list[dict[str, Any]]) -> ChatPlan:
        tools, choice = _round_tools(client_tools, search, req.tool_choice, rounds_done, retrieval.search_rounds)
        return ChatPlan(state, req, conversation, tools=tools, tool_choice=choice)

    plan = plan_for(messages)
    while True:
        params = build_params(req, engine.loaded.defaults, len(plan.prompt_ids), engine.context_length,
                              max_tokens, state.tokenizer.vocab_size, req.reasoning_effort)
        handles = submit_all(engine, [plan.prompt_ids], params, 1, await plan.constraints(state, params.max_tokens, 1))
        [result] = await results_or_disconnect(request, handles)
        results.append(result)
        prompt_tokens += len(plan.prompt_ids)
        fin = plan.finish(result)
        calls = fin["tool_calls"] or []
        mine = [c for c in calls if c["function"]["name"] == name]
        if not mine:
            break
        if len(mine) < len(calls):  # mixed with client calls: hand the client its calls, skip the search
            fin = {**fin, "tool_calls": [c for c in calls if c["function"]["name"] != name]}
            break
        turn_calls = [{"name": name, "arguments": json.loads(c["function"]["arguments"])} for c in mine]
        found, ran = [], []
        first_id = next_id = len(sources) + 1
        for call in turn_calls:
            args = dict(call["arguments"])
            # the request's k is the most passages one search may add (the model may ask for fewer)
            args["k"] = min(args["k"], retrieval.k) if isinstance(args.get("k"), int) else retrieval.k
            error, hits = await _run_search(state, args, retrieval.k, next_id)
            next_id += len(hits)
            found.append((error, hits))
            ran.append(args)
        rounds_done += 1
        assistant = {"role": "assistant", "content": fin["content"] or "", "tool_calls": turn_calls}
        keep = sum(len(h) for _, h in found)
        while True:  # drop passages from the end until the next prompt leaves the answer its room
            conversation = [*messages, assistant, *_observations(found, keep)]
            plan = plan_for(conversation)
            if keep == 0 or len(plan.prompt_ids) + answer_room <= engine.context_length:
                break
            keep -= 1
        messages = conversation
        for args, (error, hits) in zip(ran, found, strict=True):  # ids run on from first_id across the calls
            entry = {"arguments": args, "source_ids": [h["id"] for h in hits if h["id"] < first_id + keep]}
            searches.append({**entry, "error": error} if error else entry)
        sources.extend([h for _, hits in found for h in hits][:keep])
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    reply_usage = usage(prompt_tokens, results)
    if req.stream:
        gen = _replay_chat(state, req, rid, created, fin, reply_usage, {"sources": sources, "searches": searches})
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": req.model,
        "system_fingerprint": state.fingerprint, "service_tier": None,
        "choices": [{"index": 0, "message": assistant_message(fin), "logprobs": None,
                     "finish_reason": fin["finish_reason"]}],
        "usage": reply_usage, "diffusion_stats": [_summed_stats(results)], "sources": sources, "searches": searches,
    }


async def _replay_chat(
    state: ServerState, req: ChatCompletionRequest, rid: str, created: int, fin: dict[str, Any],
    reply_usage: dict[str, Any], extension: dict[str, Any],
) -> AsyncIterator[str]:
    """The finished final round as a chat stream: role (+ sources) chunk, the content in one delta, tool calls,
    finish, usage. Search rounds must finish before the server knows which round is the answer."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": req.model, "system_fingerprint": state.fingerprint, "choices": choices}
        if include_usage:
            body["usage"] = reply_usage if delta is None else None
        body.update(extra)
        return sse(body)

    yield chunk({"role": "assistant", "content": None if fin["content"] is None else ""}, **extension)
    if fin["content"]:
        yield chunk({"content": fin["content"]})
    for j, call in enumerate(fin["tool_calls"] or []):
        yield chunk({"tool_calls": [{"index": j, **call}]})
    yield chunk({}, fin["finish_reason"])
    if include_usage:
        yield chunk(None)
    yield "data: [DONE]\n\n"
