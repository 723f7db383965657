"""``POST /v1/chat/completions``: what a request asks for (:class:`ChatPlan`: prompt, constraint, tools), one
decoding round for its n choices, and the streamed form.

Streaming sends append-only deltas of *committed* text only, so a client that concatenates deltas gets
exactly the non-streamed answer. ``"diffusing": true`` (opt-in, as in Mercury) instead sends the whole
canvas at every denoising step; each such delta replaces the previous one. ``"retrieval": {"k": 5}`` (with
``--index``) puts passages for the last user message into the prompt; the built-in search tool's rounds are in
``quicksilver.api.search_rounds``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from quicksilver import structured
from quicksilver.api.dispatch import (
    SSE_HEADERS,
    check_capacity,
    check_logprobs,
    merged,
    results_or_disconnect,
    score,
    sse,
    submit_all,
    usage,
)
from quicksilver.api.errors import APIError
from quicksilver.api.logprobs import chat_logprobs
from quicksilver.api.params import build_params, check_stream_options
from quicksilver.api.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ProtocolError,
    Tool,
    check_schema,
    template_messages,
)
from quicksilver.api.state import ServerState
from quicksilver.decoding import GenerationResult
from quicksilver.engine import RequestHandle, TextStreamer
from quicksilver.tokenizer import TOOL_CALLS


def _structured():
    """The constraint builders (quicksilver.structured); a seam where tests put a stand-in."""
    return structured


class ChatPlan:
    """Everything decided about a chat request before decoding (prompt, params, constraint, tools)."""

    def __init__(
        self, state: ServerState, req: ChatCompletionRequest, messages: list[dict[str, Any]],
        tools: list[Tool] | None = None, tool_choice: Any = None,
    ):
        """``tools``/``tool_choice``, when given, replace the request's (the built-in search rounds change them)."""
        tok = state.tokenizer
        self._tok = tok
        self.req = req
        self.tools: list[Tool] = list(req.tools or []) if tools is None else list(tools)
        choice = tool_choice if tool_choice is not None else req.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise APIError(400, f"tool_choice names an unknown function {choice.function.name!r}",
                           param="tool_choice")
        for i, t in enumerate(self.tools):
            if t.function.parameters is not None:
                if error := structured.tools.parameters_error(t.function.parameters):
                    raise APIError(400, f"invalid schema for function {t.function.name!r}: {error}",
                                   param=f"tools[{i}].function.parameters")
                try:
                    check_schema(t.function.parameters, f"tools[{i}].function.parameters")
                except ProtocolError as exc:
                    raise APIError(400, str(exc), param=exc.param) from None
        self.tool_choice = choice
        self.use_tools = choice != "none"
        self.forced_tools = choice == "required" or isinstance(choice, NamedToolChoice)
        self.tool_token = tok.token_id(TOOL_CALLS) if self.use_tools else None
        if self.use_tools and self.tool_token is None:
            raise APIError(400, "this model has no tool-call token; tools are not supported", param="tools")
        self.response_format = req.response_format if not self.forced_tools else None
        self.json_schema: dict[str, Any] | None = None
        if self.response_format is not None and self.response_format.type == "json_schema":
            js = self.response_format.json_schema
            if js is None or js.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            try:
                check_schema(js.schema_, "response_format.json_schema.schema")
            except ProtocolError as exc:
                raise APIError(400, str(exc), param=exc.param) from None
            self.json_schema = js.schema_
        self.wants_json = self.response_format is not None and self.response_format.type != "text"
        tools_for_prompt = [t.model_dump(exclude_none=True) for t in self.tools] if self.use_tools else None
        try:
            text = tok.apply_chat_template(messages, tools=tools_for_prompt, add_generation_prompt=True)
        except Exception as exc:  # a model's own Jinja template can reject a conversation
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None
        self.prompt_ids = tok.encode(text)

    def constraint_factory(self, state: ServerState, max_tokens: int):
        """A callable making one fresh constraint per choice (constraints may keep per-state data).

        Builds one now (which can take a while: call it off the event loop, as :meth:`constraints` does)."""
        from quicksilver.structured.request import constraint_factory  # one rule, shared with `quicksilver eval`
        from quicksilver.structured.schema import SchemaTooLarge

        param = self._schema_param
        try:  # builds once now so an unsupported schema is a 400 before anything is queued
            return constraint_factory(
                state.tokenizer,
                tools=[t.model_dump(exclude_none=True) for t in self.tools],
                tool_choice=(self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice)
                             else self.tool_choice),
                json_schema=self.json_schema,
                strict=self.json_schema is not None and bool(self.response_format.json_schema.strict),
                json_object=self.wants_json, max_tokens=max_tokens, builders=_structured())
        except SchemaTooLarge as exc:  # refused up front by the compiler's bounds (quick)
            raise APIError(400, f"cannot enforce this schema: {exc}", param=self._too_large_param(param),
                           code="schema_too_large") from None
        except ValueError as exc:
            raise APIError(400, f"cannot enforce this schema: {exc}", param=param) from None
        except MemoryError:  # a last resort: the bounds should refuse such a schema before it is built
            raise APIError(400, "cannot enforce this schema: it is too large to enforce", param=param,
                           code="schema_too_large") from None

    @property
    def _schema_param(self) -> str:
        """The request field whose schema a constraint enforces."""
        return "tools" if self.forced_tools else "response_format"

    def _too_large_param(self, param: str) -> str:
        """``tools[i].function.parameters`` for the (first) forced tool whose schema is too large, else ``param``."""
        if not self.forced_tools:
            return param
        from quicksilver.structured.schema import SchemaCompiler, SchemaTooLarge

        for i, t in enumerate(self.tools):
            if t.function.parameters is None:
                continue
            try:
                SchemaCompiler(t.function.parameters, strict=bool(t.function.strict)).compile()
            except SchemaTooLarge:
                return f"tools[{i}].function.parameters"
            except ValueError:
                continue
        return param

    def build_constraints(self, state: ServerState, max_tokens: int, n: int) -> list[Any] | None:
        """``n`` fresh constraints (one per choice), or None to decode freely; APIError 400 if unenforceable."""
        make = self.constraint_factory(state, max_tokens)
        if make is None:
            return None
        try:
            return [make() for _ in range(n)]
        except ValueError as exc:  # the first build succeeded: the same schema again should too
            raise APIError(400, f"cannot enforce this schema: {exc}", param=self._schema_param) from None

    async def constraints(self, state: ServerState, max_tokens: int, n: int):
        """What ``submit_all`` takes as ``constraint_for`` (None: free decoding), built in a worker thread.

        Building a schema's automata can take a second or more (a long ``minLength``, a large pattern): on the
        event loop that would stall every other request, health checks and streams meanwhile."""
        if not self.use_tools and self.json_schema is None and not self.wants_json:
            return None  # plain text: nothing to build
        built = await asyncio.to_thread(self.build_constraints, state, max_tokens, n)
        return None if built is None else iter(built).__next__

    # -- interpreting the output ----------------------------------------------------------------------
    def finish(self, result: GenerationResult) -> dict[str, Any]:
        """{"content", "tool_calls", "finish_reason"} for one choice; raises APIError if a guarantee broke."""
        from quicksilver.structured.answer import client_answer  # one rule, shared with `quicksilver eval`

        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        answer = client_answer(
            result.token_ids, result.text, result.finish_reason, self._tok,
            tools=[t.model_dump(exclude_none=True) for t in self.tools], tool_choice=choice,
            json_schema=self.json_schema, json_object=self.wants_json,
            parallel_tool_calls=self.req.parallel_tool_calls)
        if answer.error is not None:
            raise APIError(500, answer.error, "server_error", code="server_error")
        calls = None
        if answer.tool_calls:
            calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                     for c in answer.tool_calls]
        return {"content": answer.content, "tool_calls": calls, "finish_reason": answer.finish_reason}

    def stops(self) -> tuple[str, ...]:
        stop = self.req.stop
        return (stop,) if isinstance(stop, str) else tuple(stop or ())


def chat_messages(state: ServerState, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Checks that do not depend on how the chat is answered; the request's messages, ready for the template."""
    state.check_model(req.model)
    check_stream_options(req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    if req.logprobs:
        check_logprobs(state, "logprobs")
        if req.retrieval is not None and req.retrieval.mode == "tool":
            raise APIError(400, "logprobs are not supported with retrieval mode 'tool'", param="logprobs")
    if req.diffusing and not req.stream:
        raise APIError(400, "diffusing requires stream: true", param="diffusing")
    try:
        return template_messages(req.messages)
    except ProtocolError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


async def chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request,
                          messages: list[dict[str, Any]]):
    """One decoding round for n choices: the reply body, or a stream of chunks."""
    engine = state.engine
    sources = None
    if req.retrieval is not None:
        messages, sources = await retrieve_passages(state, messages, req.retrieval.k)
    plan = ChatPlan(state, req, messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = build_params(req, engine.loaded.defaults, len(plan.prompt_ids), engine.context_length,
                          max_tokens, state.tokenizer.vocab_size, req.reasoning_effort)
    check_capacity(engine, 1, req.n)  # before building n constraints for a request that cannot be served
    constraint_for = await plan.constraints(state, params.max_tokens, req.n)
    handles = submit_all(engine, [plan.prompt_ids], params, req.n, constraint_for, bool(req.diffusing))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        gen = stream_chat(state, plan, handles, rid, created, req, sources)
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await results_or_disconnect(request, handles)
    choices = []
    for i, r in enumerate(results):
        fin = plan.finish(r)
        logprobs = None
        if req.logprobs:
            scored = await score(state, plan.prompt_ids, r.token_ids, len(plan.prompt_ids), req.top_logprobs)
            logprobs = chat_logprobs(state.lexicon, scored, fin["content"])
        choices.append({"index": i, "message": assistant_message(fin), "logprobs": logprobs,
                        "finish_reason": fin["finish_reason"]})
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion", "created": created, "model": req.model,
        "system_fingerprint": state.fingerprint, "service_tier": None, "choices": choices,
        "usage": usage(len(plan.prompt_ids), results, len(results)),
        "diffusion_stats": [r.stats.to_dict() for r in results],
    }
    if sources is not None:
        body["sources"] = sources
    return body


def assistant_message(fin: dict[str, Any]) -> dict[str, Any]:
    """The reply's message for a finished choice (``ChatPlan.finish``)."""
    message: dict[str, Any] = {"role": "assistant", "content": fin["content"], "refusal": None, "annotations": []}
    if fin["tool_calls"]:
        message["tool_calls"] = fin["tool_calls"]
    return message


async def stream_chat(
    state: ServerState, plan: ChatPlan, handles: list[RequestHandle], rid: str, created: int,
    req: ChatCompletionRequest, sources: list | None,
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    tok = state.tokenizer

    def chunk(choices: list[dict[str, Any]], usage: dict | None = None, **extension: Any) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": req.model, "system_fingerprint": state.fingerprint, "choices": choices}
        if include_usage:
            body["usage"] = usage
        body.update(extension)
        return sse(body)

    def choice(i: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}

    streamers = [TextStreamer(tok, plan.stops(), plan.tool_token) for _ in handles]
    results: list[GenerationResult | None] = [None] * len(handles)
    try:
        for i in range(len(handles)):
            # an answer that may be only tool calls starts with content null (as OpenAI's do), so a client that
            # accumulates the deltas gets content None for it, as the non-streamed message has
            first: dict[str, Any] = {"role": "assistant", "content": None if plan.use_tools else ""}
            # retrieval sources (an extension field) ride on the first chunk, where clients see them early
            yield chunk([choice(i, first)], **({"sources": sources} if sources is not None and i == 0 else {}))
        async for i, u in merged(handles):
            if u.error is not None:
                err = APIError(500, f"decoding failed: {u.error}", "server_error", code="server_error")
                yield sse(err.body())
                return
            if u.result is None:
                if req.diffusing and u.canvas is not None:
                    yield chunk([choice(i, {"content": u.canvas})])
                    continue
                delta = streamers[i].push(u.committed_ids)
                if delta and not plan.forced_tools:
                    yield chunk([choice(i, {"content": delta})])
                continue
            results[i] = u.result
            try:
                fin = plan.finish(u.result)
            except APIError as err:
                yield sse(err.body())
                return
            if req.diffusing:
                final_text = fin["content"] or ""
                if final_text:
                    yield chunk([choice(i, {"content": final_text})])
            else:  # forced tool calls stream no text, but an answer cut by the length limit comes back as content
                content = fin["content"]
                rest = streamers[i].finish(content) if content else ""
                if rest or (content == "" and plan.use_tools):  # "" (not None) after a null first delta
                    yield chunk([choice(i, {"content": rest})])
            for j, call in enumerate(fin["tool_calls"] or []):
                yield chunk([choice(i, {"tool_calls": [{"index": j, **call}]})])
            if req.logprobs:  # known once the answer is whole: one chunk carries them all (clients concatenate)
                scored = await score(state, plan.prompt_ids, u.result.token_ids, len(plan.prompt_ids),
                                      req.top_logprobs)
                yield chunk([{**choice(i, {}), "logprobs": chat_logprobs(state.lexicon, scored, fin["content"])}])
            yield chunk([choice(i, {}, fin["finish_reason"])])
        if include_usage:
            done = [r for r in results if r is not None]
            yield chunk([], usage(len(plan.prompt_ids), done, len(done)))
        yield "data: [DONE]\n\n"
    finally:
        for h in handles:  # a client that disconnected frees its slots at the next step
            h.cancel()


async def retrieve_passages(state: ServerState, messages: list[dict[str, Any]], k: int):
    if state.index_path is None:
        raise APIError(400, "retrieval not available: the server was started without --index", param="retrieval")
    try:
        from quicksilver.rag.chat import augment_messages
    except ImportError:
        raise APIError(400, "retrieval not available in this build", param="retrieval") from None
    try:
        return await state.engine.run_in_worker(augment_messages, state.index_path, messages, k)
    except (ValueError, OSError, LookupError) as exc:
        raise APIError(400, f"retrieval failed: {exc}", param="retrieval") from None
