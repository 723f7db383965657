"""OpenAI-compatible HTTP server (FastAPI) on top of :class:`quicksilver.engine.Engine`.

Routes: ``POST /v1/chat/completions`` (:mod:`quicksilver.api.chat`, and :mod:`quicksilver.api.search_rounds` for
the built-in search tool), ``POST /v1/completions`` (:mod:`quicksilver.api.completions`, with ``suffix`` for
fill-in-the-middle; ``POST /v1/fim/completions`` is the same with a required suffix, as Mercury serves it),
``GET /v1/models``, ``GET /health``, ``GET /metrics``; ``POST /v1/embeddings`` when the RAG
module is installed. Every error is an OpenAI envelope (:mod:`quicksilver.api.errors`). Request fields become
decoding parameters in :mod:`quicksilver.api.params`; :mod:`quicksilver.api.dispatch` hands requests to the engine.
"""

from __future__ import annotations

import contextlib
import secrets
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quicksilver import __version__
from quicksilver.api import chat, search_rounds
from quicksilver.api import completions as completions_route
from quicksilver.api.errors import APIError, install_error_handlers
from quicksilver.api.protocol import ChatCompletionRequest, CompletionRequest, FimCompletionRequest
from quicksilver.api.state import ServerState
from quicksilver.checkpoint import LoadedModel
from quicksilver.decoding import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB
from quicksilver.engine import Engine, model_thread


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
    install_error_handlers(app)

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
        messages = chat.chat_messages(state, req)
        if req.retrieval is not None and req.retrieval.mode == "tool":
            return await search_rounds.chat_with_search_tool(state, req, request, messages)
        return await chat.chat_completion(state, req, request, messages)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await completions_route.completion(state, req, request)

    @v1.post("/fim/completions")  # Mercury's fill-in-the-middle route: /v1/completions with a required suffix
    async def fim_completions(req: FimCompletionRequest, request: Request):
        return await completions_route.completion(state, req, request)

    app.include_router(v1)
    try:  # the RAG engineer's embeddings endpoint, when installed
        from quicksilver.api import embeddings as embeddings_module

        app.include_router(embeddings_module.router, dependencies=[Depends(require_key)])
    except ImportError:
        pass
    return app
