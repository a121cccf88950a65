"""The one table from exceptions to HTTP status and the OpenAI error body.

    StrataError with a status      -> what its class says (strata/errors.py): RequestError 400 /
                                      404 / 413, ConflictError 409, StoreUnavailableError 503,
                                      OverloadedError 429 or 503, EngineDeadError 503,
                                      RequestFailedError 500 (the executor failed on this
                                      request alone), DeadlineExceededError 504 (with
                                      x-should-retry: false); a 503 carries Retry-After
    pydantic / JSON validation     -> 400 invalid_request_error (never 422)
    Starlette HTTPException        -> its status (404 unknown route, 405 wrong method)
    ClientDisconnect               -> 499 (nobody reads it; the engine requests were aborted)
    anything else                  -> 500 with a generic message; the exception is logged

The body itself is built by strata.protocol.errors, shared with the gateway and auth.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from strata.errors import (
    ConflictError,
    DeadlineExceededError,
    EngineDeadError,
    OverloadedError,
    RequestError,
    RequestFailedError,
    StoreUnavailableError,
    StrataError,
)
from strata.protocol.errors import ErrorMapping, describe

logger = logging.getLogger("strata.server")
_ANSWERED = (RequestError, ConflictError, StoreUnavailableError, OverloadedError, EngineDeadError,
             RequestFailedError, DeadlineExceededError)


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
    if isinstance(exc, EngineDeadError):
        described = describe(exc)
        return ErrorMapping(503, f"the engine has stopped: {exc}", described.type,
                            headers=described.headers)
    if isinstance(exc, _ANSWERED):
        assert isinstance(exc, StrataError)
        return describe(exc)
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
    logger.error("internal error while serving a request", exc_info=exc)
    return ErrorMapping(500, "internal server error", "internal_server_error")


def error_response(exc: BaseException) -> JSONResponse:
    """The HTTP response for `exc` (OpenAI error body)."""
    mapping = map_exception(exc)
    return JSONResponse(mapping.payload(), status_code=mapping.status_code,
                        headers=mapping.headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through `map_exception`."""
    for kind in (*_ANSWERED, ValidationError, RequestValidationError, HTTPException,
                 ClientDisconnect, json.JSONDecodeError, Exception):
        app.add_exception_handler(kind, _handle)


__all__ = ["ErrorMapping", "error_response", "install_error_handlers", "map_exception"]
