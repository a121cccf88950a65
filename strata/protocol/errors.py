"""The one OpenAI error body, built here for the instance server, the gateway and API-key auth.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

`type` names the kind of error (the HTTP status's default unless the error says otherwise);
`code` is OpenAI's short machine-readable string ("context_length_exceeded",
"invalid_api_key", "rate_limit_exceeded", ...) or null, never the HTTP status. A `StrataError`
says its own status, type and code (see strata/errors.py); `describe` reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from strata.errors import DeadlineExceededError, OverloadedError, RequestError, StrataError

DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "overloaded_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_error",
}


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    """What one error is answered with: status, the body's fields, extra headers."""

    status_code: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        return error_payload(self.status_code, self.message, kind=self.type, param=self.param,
                             code=self.code)


def error_payload(status_code: int, message: str, *, kind: str | None = None,
                  param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body as a dict; `kind` defaults to the status's usual type."""
    kind = kind or DEFAULT_TYPES.get(status_code, "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_json(status_code: int, message: str, *, kind: str | None = None,
               param: str | None = None, code: str | None = None) -> bytes:
    """`error_payload` encoded as JSON bytes."""
    return json.dumps(error_payload(status_code, message, kind=kind, param=param,
                                    code=code)).encode()


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def describe(exc: StrataError) -> ErrorMapping:
    """How a Strata error is answered, from what its class says (strata/errors.py)."""
    message = exc.message if isinstance(exc, RequestError | OverloadedError) else str(exc)
    param = exc.param if isinstance(exc, RequestError) else None
    headers: dict[str, str] = {}
    if isinstance(exc, OverloadedError):
        headers = retry_after(exc.retry_after_s)
    elif exc.status_code == 503:
        headers = retry_after(1.0)
    elif isinstance(exc, DeadlineExceededError):
        headers = {"x-should-retry": "false"}  # the openai client would retry a 504
    return ErrorMapping(exc.status_code, message, exc.error_type, param, exc.code, headers)


__all__ = ["DEFAULT_TYPES", "ErrorMapping", "describe", "error_json", "error_payload",
           "retry_after"]
