"""The one table from exceptions to HTTP status and the OpenAI error body.

    RequestError (and subclasses)  -> its status_code (400 / 404 / 413)
    pydantic / JSON validation     -> 400 invalid_request_error (never 422)
    Starlette HTTPException        -> its status (404 unknown route, 405 wrong method)
    ClientDisconnect               -> 499 (nobody reads it; the engine requests were aborted)
    OverloadedError                -> its status_code (429 queue full, 503 draining) + Retry-After
    EngineDeadError                -> 503 + Retry-After
    anything else                  -> 500 with a generic message; the exception is logged
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from strata.errors import EngineDeadError, OverloadedError, RequestError
from strata.protocol.openai import ErrorInfo, ErrorResponse

logger = logging.getLogger("strata.server")


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    status_code: int
    message: str
    type: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def map_exception(exc: BaseException) -> ErrorMapping:
    """Status, OpenAI error fields and headers for any exception."""
    if isinstance(exc, RequestError):
        return ErrorMapping(exc.status_code, exc.message, exc.error_type, exc.param)
    if isinstance(exc, ValidationError | RequestValidationError):
        message, param = _validation_message(exc)
        return ErrorMapping(400, message, "invalid_request_error", param)
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return ErrorMapping(400, f"request body is not valid JSON: {exc}", "invalid_request_error")
    if isinstance(exc, ClientDisconnect):  # nobody reads this answer; not worth a log line
        return ErrorMapping(499, "the client closed the request", "client_closed_request")
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ErrorMapping(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))
    if isinstance(exc, OverloadedError):
        kind = "overloaded_error" if exc.status_code == 429 else "service_unavailable_error"
        headers = _retry_after(exc.retry_after_s)
        return ErrorMapping(exc.status_code, exc.message, kind, headers=headers)
    if isinstance(exc, EngineDeadError):
        return ErrorMapping(503, f"the engine has stopped: {exc}", "service_unavailable_error",
                            headers=_retry_after(1.0))
    logger.error("internal error while serving a request", exc_info=exc)
    return ErrorMapping(500, "internal server error", "internal_server_error")


def error_body(mapping: ErrorMapping) -> ErrorResponse:
    info = ErrorInfo(message=mapping.message, type=mapping.type, param=mapping.param,
                     code=mapping.status_code)
    return ErrorResponse(error=info)


def error_response(exc: BaseException) -> JSONResponse:
    """The HTTP response for `exc` (OpenAI error body)."""
    mapping = map_exception(exc)
    return JSONResponse(error_body(mapping).model_dump(), status_code=mapping.status_code,
                        headers=mapping.headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through `map_exception`."""
    for kind in (RequestError, OverloadedError, EngineDeadError, ValidationError,
                 RequestValidationError, HTTPException, ClientDisconnect, json.JSONDecodeError,
                 Exception):
        app.add_exception_handler(kind, _handle)


__all__ = ["ErrorMapping", "error_body", "error_response", "install_error_handlers",
           "map_exception"]
