"""OpenAI-compatible HTTP server (FastAPI) on top of :class:`quicksilver.engine.Engine`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (with ``suffix`` for fill-in-the-middle),
``GET /v1/models``, ``GET /health``, ``GET /metrics``; ``POST /v1/embeddings`` when the RAG module is
installed. Every error is an OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

Streaming sends append-only deltas of *committed* text only, so a client that concatenates deltas gets
exactly the non-streamed answer. ``"diffusing": true`` (opt-in, as in Mercury) instead sends the whole
canvas at every denoising step; each such delta replaces the previous one.

``reasoning_effort`` picks how many tokens a denoising step may commit (Mercury's "refinement steps"):
``instant``/``minimal``/``none`` threshold 0.7, ``low`` 0.8, ``medium`` 0.9, ``high``/``xhigh`` one
token per step (low-confidence policy). A model whose default policy is ``self_speculative`` keeps it and
the effort sets how close to the causal top token an accepted draft must be (``accept_ratio``: 0.1, 0.25,
0.5, then 1.0 = exactly its causal greedy answer; greedy requests only, sampled ones stay exact): on the
shipped default that is faster and more accurate than the thresholds above (docs/performance.md section 7).
Without it the model's defaults apply.

``"retrieval"`` (with ``--index``): ``{"k": 5}`` puts passages for the last user message into the prompt;
``{"mode": "tool"}`` offers the built-in ``search_documents`` tool and runs it here, for a bounded number of
search rounds (see docs/rag.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from quicksilver import __version__, structured
from quicksilver.api.logprobs import chat_logprobs, completion_logprobs
from quicksilver.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ProtocolError,
    SamplingFields,
    Tool,
    check_schema,
    template_messages,
)
from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB, GenerationResult
from quicksilver.engine import (
    Engine,
    EngineClosed,
    EngineError,
    EngineOverloaded,
    RequestHandle,
    StepUpdate,
    TextStreamer,
    model_thread,
)
from quicksilver.sampling import SamplingParams
from quicksilver.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, TOOL_CALLS

log = logging.getLogger("quicksilver.api")

EFFORT_PARAMS: dict[str, dict[str, Any]] = {
    "none": {"policy": "threshold", "threshold": 0.7},
    "minimal": {"policy": "threshold", "threshold": 0.7},
    "instant": {"policy": "threshold", "threshold": 0.7},
    "low": {"policy": "threshold", "threshold": 0.8},
    "medium": {"policy": "threshold", "threshold": 0.9},
    "high": {"policy": "low_confidence", "steps_per_block": None},
    "xhigh": {"policy": "low_confidence", "steps_per_block": None},
}
# for a model that verifies its own drafts: how near the causal top token a draft must be to be accepted
SPECULATIVE_EFFORT_PARAMS: dict[str, dict[str, Any]] = {
    "none": {"accept_ratio": 0.1},
    "minimal": {"accept_ratio": 0.1},
    "instant": {"accept_ratio": 0.1},
    "low": {"accept_ratio": 0.25},
    "medium": {"accept_ratio": 0.5},
    "high": {"accept_ratio": 1.0},
    "xhigh": {"accept_ratio": 1.0},
}


# -- errors ---------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message from pydantic's errors (never the raw dump)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # drop pydantic's union branch names ("str", "list[...]") from the location
    loc = [x for x in loc if not (x in ("str", "int", "list", "dict") or "[" in x or x.startswith("function-"))]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}", param
    if kind == "missing":
        if param is None:  # no body at all
            return "the request body is empty; expected a JSON object", None
        return f"missing required field {param!r}", param
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ProtocolError):  # a check of the whole request that knows which field failed
        return str(cause), cause.param
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param, code="invalid_value" if param else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no such route: OpenAI's wording
            message = f"Invalid URL ({request.method} {request.url.path})"
        return error_response(APIError(exc.status_code, message, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(500, "internal server error", "server_error", code="server_error"))


# -- app state ------------------------------------------------------------------------------------------
class ServerState:
    def __init__(self, engine: Engine, api_key: str | None, model_names: list[str], index_path: str | None):
        self.engine = engine
        self.api_key = api_key
        self.model_names = model_names
        self.index_path = index_path
        self.created = int(time.time())
        digest = hashlib.sha256(f"{engine.loaded.path}|{__version__}".encode()).hexdigest()[:10]
        self.fingerprint = f"qs-{digest}"

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def lexicon(self):
        """Each token's bytes (logprobs report them), shared with the structured-output constraints."""
        from quicksilver.structured.lexicon import lexicon_for

        return lexicon_for(self.engine.tokenizer)

    def check_model(self, name: str) -> str:
        if name not in self.model_names:
            raise APIError(404, f"The model {name!r} does not exist (served: {', '.join(self.model_names)})",
                           "invalid_request_error", "model", "model_not_found")
        return name


def _structured():
    """The constraint builders (quicksilver.structured); a seam where tests put a stand-in."""
    return structured


# -- request -> decoding parameters ---------------------------------------------------------------------
def build_params(
    req: SamplingFields, defaults: SamplingParams, prompt_len: int, context: int,
    max_tokens: int | None, vocab_size: int, effort: str | None = None, prompt_param: str = "messages",
) -> SamplingParams:
    room = context - prompt_len
    if room < 1:
        raise _prompt_too_long(context, prompt_len, prompt_param)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                            "the completion).", param="max_tokens", code="context_length_exceeded")
    changes: dict[str, Any] = {"max_tokens": max_tokens if max_tokens is not None else min(defaults.max_tokens, room)}
    if req.temperature is not None:
        changes["temperature"] = req.temperature
    if req.top_p is not None:
        if req.top_p == 0:  # some clients send 0 for "most likely token only"
            changes["temperature"] = 0.0
        else:
            changes["top_p"] = req.top_p
    if req.top_k is not None:
        changes["top_k"] = req.top_k
    if req.seed is not None:
        changes["seed"] = req.seed
    if req.stop is not None:
        changes["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            changes[name] = getattr(req, name)
    if req.logit_bias:
        changes["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    if effort is not None:
        # a model that verifies its drafts returns its own causal greedy answer at accept_ratio 1: its most
        # careful setting, better than one unverified token per step; looser acceptance is its faster one
        table = SPECULATIVE_EFFORT_PARAMS if defaults.policy == "self_speculative" else EFFORT_PARAMS
        changes.update(table[effort])
    try:
        return defaults.replace(**changes)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _prompt_too_long(context: int, prompt_len: int, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                         f"{prompt_len} tokens.", param=param, code="context_length_exceeded")


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        out[token] = value
    return out


def _unsupported(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def _check_logprobs(state: ServerState, param: str) -> None:
    from quicksilver.decoding.scoring import supports_logprobs

    if not supports_logprobs(state.engine.loaded.model.config):
        raise APIError(400, "this model has no left-to-right distribution to report logprobs from (a "
                            "bidirectional diffusion model)", param=param)


async def _score(state: ServerState, prompt_ids: Sequence[int], answer_ids: Sequence[int], start: int,
                 top: int | None) -> list:
    """Token log-probabilities of prompt + answer from ``start`` on (slot fillers left out), on the model thread."""
    from quicksilver.decoding.scoring import token_logprobs

    filler = state.lexicon.filler_id
    ids = [*prompt_ids, *(t for t in answer_ids if t != filler)]
    return await state.engine.run_in_worker(token_logprobs, state.engine.loaded.model, ids, start, top or 0)


def _submit_all(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
    constraint_for=None, snapshots: bool = False,
) -> list[RequestHandle]:
    """Submit n choices per prompt (seed + i per choice); all-or-nothing."""
    total, capacity = len(prompts) * n, engine.max_batch + engine.max_queue
    if total > capacity:  # more than the server ever holds at once: a retry (what a 429 asks for) cannot succeed
        asked = f"{len(prompts)} prompt{'s' * (len(prompts) != 1)} x n={n}"
        raise APIError(400, f"this request asks for {total} completions ({asked}) but the server holds at most "
                            f"{capacity} at a time", param="n" if len(prompts) == 1 else "prompt")
    handles: list[RequestHandle] = []
    try:
        for ids in prompts:
            for i in range(n):
                p = params if params.seed is None or i == 0 else params.replace(seed=params.seed + i)
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


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StepUpdate]]:
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


async def _results_or_disconnect(request: Request, handles: list[RequestHandle]) -> list[GenerationResult]:
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


def _usage(prompt_tokens: int, results: Sequence[GenerationResult], choices_per_prompt: int = 1) -> dict[str, Any]:
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- chat: what a request asks for ------------------------------------------------------------------------
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
        """A callable making one fresh constraint per choice (constraints may keep per-state data)."""
        from quicksilver.structured.request import constraint_factory  # one rule, shared with `quicksilver eval`

        try:  # builds once now so an unsupported schema is a 400 before anything is queued
            return constraint_factory(
                state.tokenizer,
                tools=[t.model_dump(exclude_none=True) for t in self.tools],
                tool_choice=(self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice)
                             else self.tool_choice),
                json_schema=self.json_schema,
                strict=self.json_schema is not None and bool(self.response_format.json_schema.strict),
                json_object=self.wants_json, max_tokens=max_tokens, builders=_structured())
        except ValueError as exc:
            raise APIError(400, f"cannot enforce this schema: {exc}",
                           param="tools" if self.forced_tools else "response_format") from None

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


# -- app factory ----------------------------------------------------------------------------------------
def create_app(
    engine_or_model: Engine | LoadedModel | str | Path | None = None,
    api_key: str | None = None,
    index_path: str | None = None,
    served_model_name: str | None = None,
    max_batch: int = 32,
    max_queue: int = 256,
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    worker: Executor | None = None,
) -> FastAPI:
    """Build the FastAPI app. ``engine_or_model`` is an Engine, a LoadedModel, or a model name/folder (loaded on the
    engine's model thread); ``prefix_cache_mb`` sizes the prefix cache shared by requests (0: off),
    ``prefill_chunk`` caps the prompt tokens a request computes per forward (0: whole prompts) and ``worker`` is
    the model thread (``engine.model_thread()``, the one that loaded the weights) of an engine built here."""
    if isinstance(engine_or_model, Engine):
        engine = engine_or_model
    else:
        if not isinstance(engine_or_model, LoadedModel):
            from quicksilver.loading import load_model

            worker = worker or model_thread()
            name = None if engine_or_model is None else str(engine_or_model)
            engine_or_model = worker.submit(load_model, name).result()
        engine = Engine(engine_or_model, max_batch=max_batch, max_queue=max_queue, prefix_cache_mb=prefix_cache_mb,
                        prefill_chunk=prefill_chunk, worker=worker)
    names = [served_model_name or engine.loaded.name]
    state = ServerState(engine, api_key, names, index_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain=True)  # SIGTERM: uvicorn stops accepting, we finish in-flight work

    app = FastAPI(title="Quicksilver", version=__version__, lifespan=lifespan)
    app.state.qs = state
    _install_error_handlers(app)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        engine.metrics.http_requests.labels(getattr(route, "path", "other"), str(response.status_code)).inc()
        return response

    async def require_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), state.api_key):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.started and not engine._closing
        body = {"status": "ok" if ok else "unavailable", "model": names[0],
                "running": len(engine.running), "queued": len(engine.waiting)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "quicksilver",
                "context_length": engine.context_length, "max_model_len": engine.context_length}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in names]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return model_card(state.check_model(model_id))

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        state.check_model(req.model)
        _unsupported(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if req.logprobs:
            _check_logprobs(state, "logprobs")
            if req.retrieval is not None and req.retrieval.mode == "tool":
                raise APIError(400, "logprobs are not supported with retrieval mode 'tool'", param="logprobs")
        if req.diffusing and not req.stream:
            raise APIError(400, "diffusing requires stream: true", param="diffusing")
        try:
            messages = template_messages(req.messages)
        except ProtocolError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        sources = None
        if req.retrieval is not None and req.retrieval.mode == "tool":
            return await _chat_with_search_tool(state, req, request, messages)
        if req.retrieval is not None:
            messages, sources = await _retrieve(state, messages, req.retrieval.k)
        plan = ChatPlan(state, req, messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = build_params(req, engine.loaded.defaults, len(plan.prompt_ids), engine.context_length,
                              max_tokens, state.tokenizer.vocab_size, req.reasoning_effort)
        constraint_for = plan.constraint_factory(state, params.max_tokens)
        handles = _submit_all(engine, [plan.prompt_ids], params, req.n, constraint_for, bool(req.diffusing))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            gen = _stream_chat(state, plan, handles, rid, created, req, sources)
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        results = await _results_or_disconnect(request, handles)
        choices = []
        for i, r in enumerate(results):
            fin = plan.finish(r)
            message: dict[str, Any] = {"role": "assistant", "content": fin["content"], "refusal": None,
                                       "annotations": []}
            if fin["tool_calls"]:
                message["tool_calls"] = fin["tool_calls"]
            logprobs = None
            if req.logprobs:
                scored = await _score(state, plan.prompt_ids, r.token_ids, len(plan.prompt_ids), req.top_logprobs)
                logprobs = chat_logprobs(state.lexicon, scored, fin["content"])
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": fin["finish_reason"]})
        body: dict[str, Any] = {
            "id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "system_fingerprint": state.fingerprint, "service_tier": None, "choices": choices,
            "usage": _usage(len(plan.prompt_ids), results, len(results)),
            "diffusion_stats": [r.stats.to_dict() for r in results],
        }
        if sources is not None:
            body["sources"] = sources
        return body

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        state.check_model(req.model)
        _unsupported(req)
        if req.logprobs is not None:
            _check_logprobs(state, "logprobs")
            if req.stream:
                raise APIError(400, "logprobs are not supported with stream: true on /v1/completions",
                               param="logprobs")
            if req.echo and req.suffix is not None:
                raise APIError(400, "logprobs of an echoed fill-in-the-middle prompt are not supported",
                               param="logprobs")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
        prompts = _completion_prompts(state, req)
        if req.max_tokens == 0:  # score the prompts only (echo + logprobs), as OpenAI's legacy endpoint allowed
            return await _score_prompts(state, req, prompts)
        longest = max(len(ids) for ids, _ in prompts)
        params = build_params(req, engine.loaded.defaults, longest, engine.context_length, req.max_tokens,
                              state.tokenizer.vocab_size, prompt_param="prompt")
        handles = _submit_all(engine, [ids for ids, _ in prompts], params, req.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        echoes = [echo if req.echo else "" for _, echo in prompts for _ in range(req.n)]
        if req.stream:
            gen = _stream_completion(state, handles, rid, created, req, echoes, prompt_tokens)
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        results = await _results_or_disconnect(request, handles)
        choices = [{"index": i, "text": echoes[i] + r.text, "logprobs": None, "finish_reason": r.finish_reason}
                   for i, r in enumerate(results)]
        if req.logprobs is not None:
            for i, r in enumerate(results):
                ids = prompts[i // req.n][0]
                start = 1 if req.echo else len(ids)  # the echoed prompt's tokens are scored too
                scored = await _score(state, ids, r.token_ids, start, req.logprobs)
                cut = len(ids) - start
                choices[i]["logprobs"] = completion_logprobs(
                    state.lexicon, ids if req.echo else None, scored[:cut], scored[cut:], r.text, req.logprobs > 0)
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "system_fingerprint": state.fingerprint, "choices": choices,
                "usage": _usage(prompt_tokens, results, req.n)}

    app.include_router(v1)
    try:  # the RAG engineer's embeddings endpoint, when installed
        from quicksilver.api import embeddings as embeddings_module

        app.include_router(embeddings_module.router, dependencies=[Depends(require_key)])
    except ImportError:
        pass
    return app


def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[tuple[list[int], str]]:
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


async def _score_prompts(state: ServerState, req: CompletionRequest, prompts: list[tuple[list[int], str]]) -> dict:
    """``max_tokens: 0``: no generation; each prompt echoed (when asked) with its tokens' log-probabilities."""
    if req.stream:
        raise APIError(400, "max_tokens 0 is not supported with stream: true", param="max_tokens")
    if req.suffix is not None:
        raise APIError(400, "max_tokens 0 is not supported with suffix", param="max_tokens")
    choices = []
    for ids, echo in prompts:
        if len(ids) > state.engine.context_length:
            raise _prompt_too_long(state.engine.context_length, len(ids), "prompt")
        logprobs = None
        if req.logprobs is not None and req.echo:
            scored = await _score(state, ids, [], 1, req.logprobs)
            logprobs = completion_logprobs(state.lexicon, ids, scored, [], "", req.logprobs > 0)
        for _ in range(req.n):
            choices.append({"index": len(choices), "text": echo if req.echo else "", "logprobs": logprobs,
                            "finish_reason": "length"})
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "system_fingerprint": state.fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


async def _retrieve(state: ServerState, messages: list[dict[str, Any]], k: int):
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


# -- the built-in search_documents tool ("retrieval": {"mode": "tool"}) ----------------------------------
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


async def _chat_with_search_tool(
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
        handles = _submit_all(engine, [plan.prompt_ids], params, 1, plan.constraint_factory(state, params.max_tokens))
        [result] = await _results_or_disconnect(request, handles)
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
    usage = _usage(prompt_tokens, results)
    if req.stream:
        gen = _replay_chat(state, req, rid, created, fin, usage, {"sources": sources, "searches": searches})
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    message: dict[str, Any] = {"role": "assistant", "content": fin["content"], "refusal": None, "annotations": []}
    if fin["tool_calls"]:
        message["tool_calls"] = fin["tool_calls"]
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": req.model,
        "system_fingerprint": state.fingerprint, "service_tier": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": fin["finish_reason"]}],
        "usage": usage, "diffusion_stats": [_summed_stats(results)], "sources": sources, "searches": searches,
    }


async def _replay_chat(
    state: ServerState, req: ChatCompletionRequest, rid: str, created: int, fin: dict[str, Any],
    usage: dict[str, Any], extension: dict[str, Any],
) -> AsyncIterator[str]:
    """The finished final round as a chat stream: role (+ sources) chunk, the content in one delta, tool calls,
    finish, usage. Search rounds must finish before the server knows which round is the answer."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": req.model, "system_fingerprint": state.fingerprint, "choices": choices}
        if include_usage:
            body["usage"] = usage if delta is None else None
        body.update(extra)
        return _sse(body)

    yield chunk({"role": "assistant", "content": None if fin["content"] is None else ""}, **extension)
    if fin["content"]:
        yield chunk({"content": fin["content"]})
    for j, call in enumerate(fin["tool_calls"] or []):
        yield chunk({"tool_calls": [{"index": j, **call}]})
    yield chunk({}, fin["finish_reason"])
    if include_usage:
        yield chunk(None)
    yield "data: [DONE]\n\n"


# -- streaming ------------------------------------------------------------------------------------------
async def _stream_chat(
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
        return _sse(body)

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
        async for i, u in _merged(handles):
            if u.error is not None:
                err = APIError(500, f"decoding failed: {u.error}", "server_error", code="server_error")
                yield _sse(err.body())
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
                yield _sse(err.body())
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
                scored = await _score(state, plan.prompt_ids, u.result.token_ids, len(plan.prompt_ids),
                                      req.top_logprobs)
                yield chunk([{**choice(i, {}), "logprobs": chat_logprobs(state.lexicon, scored, fin["content"])}])
            yield chunk([choice(i, {}, fin["finish_reason"])])
        if include_usage:
            done = [r for r in results if r is not None]
            yield chunk([], _usage(len(plan.prompt_ids), done, len(done)))
        yield "data: [DONE]\n\n"
    finally:
        for h in handles:  # a client that disconnected frees its slots at the next step
            h.cancel()


async def _stream_completion(
    state: ServerState, handles: list[RequestHandle], rid: str, created: int, req: CompletionRequest,
    echoes: list[str], prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    streamers = [TextStreamer(state.tokenizer, stops) for _ in handles]
    results: list[GenerationResult | None] = [None] * len(handles)  # in handle order: n choices per prompt

    def chunk(i: int, text: str, finish: str | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                                "system_fingerprint": state.fingerprint,
                                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return _sse(body)

    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
        async for i, u in _merged(handles):
            if u.error is not None:
                yield _sse(APIError(500, f"decoding failed: {u.error}", "server_error", code="server_error").body())
                return
            if u.result is None:
                delta = streamers[i].push(u.committed_ids)
                if delta:
                    yield chunk(i, delta)
                continue
            results[i] = u.result
            yield chunk(i, streamers[i].finish(u.result.text), u.result.finish_reason)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                        "system_fingerprint": state.fingerprint, "choices": [],
                        "usage": _usage(prompt_tokens, [r for r in results if r is not None], req.n)})
        yield "data: [DONE]\n\n"
    finally:
        for h in handles:
            h.cancel()
