"""What the gateway answers when no route did: always the OpenAI error body, never plain text.

    Starlette HTTPException   its status: 404 unknown path, 405 wrong method (with Allow)
    StrataError               what its class says (strata/errors.py), via strata.protocol.errors
    anything else             500 "internal server error"; the exception is logged with its trace
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from strata.errors import StrataError
from strata.protocol.errors import describe, error_json

logger = logging.getLogger("strata.gateway")


def _json(status_code: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code, headers=headers, media_type="application/json")


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _json(exc.status_code, error_json(exc.status_code, str(exc.detail), kind=kind),
                 dict(exc.headers or {}))


async def strata_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StrataError)
    mapping = describe(exc)
    if mapping.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc)
    body = error_json(mapping.status_code, mapping.message, kind=mapping.type,
                      param=mapping.param, code=mapping.code)
    return _json(mapping.status_code, body, mapping.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(500, error_json(500, "internal server error"))


EXCEPTION_HANDLERS = {HTTPException: http_error, StrataError: strata_error,
                      Exception: internal_error}

__all__ = ["EXCEPTION_HANDLERS"]
