"""The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers turn request-validation errors, unknown routes and unexpected exceptions into that envelope, with a
one-line message (never pydantic's raw dump or a traceback).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quicksilver.api.protocol import ProtocolError

log = logging.getLogger("quicksilver.api")


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


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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
        if isinstance(first.get("input"), bytes):  # the body was not read as JSON: its Content-Type is another
            return "the request body must be a JSON object, sent with Content-Type: application/json", None
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
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

