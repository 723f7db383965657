"""``POST /v1/embeddings`` (OpenAI shape) backed by all-MiniLM-L6-v2.

The body is validated here (not by FastAPI's parameter machinery) so that every bad request gets the OpenAI
error envelope ``{"error": {"message", "type", "param", "code"}}`` whatever exception handlers the app has.
"""

from __future__ import annotations

import base64
import json
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

MAX_INPUTS = 2048
MODEL_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "all-minilm", "minilm"}

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids: true or 1.0 is no id
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # as OpenAI types it: "384", 384.0 or true is no number of dimensions
    user: str | None = None


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def _inputs(req: EmbeddingRequest) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, token-id lists): exactly one is set. Token ids are MiniLM word-piece ids, as OpenAI allows."""
    value = req.input
    if isinstance(value, str):
        return [value], None
    if not value:
        return [], None
    if all(isinstance(v, str) for v in value):
        return list(value), None
    if all(isinstance(v, int) for v in value):
        return None, [list(value)]
    return None, [list(v) for v in value]


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> JSONResponse:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return error(400, "the request body is not valid JSON")
    except RecursionError:  # arrays or objects nested thousands deep
        return error(400, "the request body is not valid JSON: nested too deeply")
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object")
    from quicksilver.api.protocol import ProtocolError, check_unicode

    try:
        check_unicode(body)
    except ProtocolError as exc:
        return error(400, str(exc), exc.param)
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "missing":  # the wording of the other routes (quicksilver.api.errors)
            return error(400, f"missing required field {param!r}", param=param)
        if first["type"] == "extra_forbidden":
            return error(400, f"unknown field {param!r}", param=param)
        if param == "input":  # a union: pydantic's per-branch message would only confuse
            return error(400, "input must be a string, a list of strings, or token-id arrays", param="input")
        return error(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)

    from quicksilver.embeddings import DIM, MODEL_NAME

    if req.model.lower() not in MODEL_ALIASES:
        return error(404, f"The model '{req.model}' does not exist; embeddings use '{MODEL_NAME}'", "model",
                     "model_not_found")
    if req.dimensions is not None and req.dimensions != DIM:
        return error(400, f"{MODEL_NAME} returns {DIM} dimensions; dimensions={req.dimensions} is not supported",
                     "dimensions")
    texts, id_lists = _inputs(req)
    count = len(texts if texts is not None else id_lists)
    if count == 0:
        return error(400, "input must not be empty", "input")
    if count > MAX_INPUTS:
        return error(400, f"at most {MAX_INPUTS} inputs per request, got {count}", "input")
    if texts is not None and any(not t for t in texts):
        return error(400, "input strings must not be empty", "input")
    if id_lists is not None and any(not ids for ids in id_lists):
        return error(400, "token arrays must not be empty", "input")

    server = getattr(request.app.state, "qs", None)  # mounted on the Quicksilver server, or on a bare app
    if server is not None:  # on the model thread: one thread runs all torch work (quicksilver.engine.model_thread)
        vectors, tokens = await server.engine.run_in_worker(_embed, texts, id_lists)
    else:
        vectors, tokens = await run_in_threadpool(_embed, texts, id_lists)
    if vectors is None:
        return error(400, tokens, "input")  # tokens carries the message when the ids were out of range
    data = []
    for i, vec in enumerate(vectors):
        if req.encoding_format == "base64":
            emb = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
        else:
            emb = [float(x) for x in vec]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return JSONResponse({"object": "list", "data": data, "model": MODEL_NAME,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _embed(texts: list[str] | None, id_lists: list[list[int]] | None):
    from quicksilver.embeddings import get_embedder

    embedder = get_embedder()
    if texts is not None:
        ids = embedder.encode_ids(texts)
    else:
        vocab = embedder.cfg.vocab_size
        if any(not 0 <= t < vocab for seq in id_lists for t in seq):
            return None, f"token ids must be in [0, {vocab})"
        ids = [seq[: embedder.max_length] for seq in id_lists]
    return embedder.embed_ids(ids), sum(len(s) for s in ids)
