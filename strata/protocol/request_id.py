"""`X-Request-Id`: one id per HTTP request, carried from the gateway to the instance and into
every log line written while the request is served.

`RequestIdMiddleware` (outermost on the gateway and on the instance server) takes the client's
header when it is sane (`is_sane`), else makes a new id; it writes the chosen id back into the
request's headers, so the gateway's proxy, which forwards the client's headers, hands the same
id to the instance, and into the response's headers. While the request is served the id is
`current_request_id()`, which strata/logs.py adds to each log record.

Each request runs in a task of its own (uvicorn starts one per request), so the value set here
ends with the request. It is deliberately not reset when the app returns: the outermost error
handler, which logs a request's unexpected exception, runs after this middleware has returned.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
_HEADER = REQUEST_ID_HEADER.encode()
_SANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
_current: ContextVar[str | None] = ContextVar("strata_request_id", default=None)


def is_sane(value: str) -> bool:
    """1-128 characters of letters, digits and `._:-` (a UUID, a ULID, a trace id), starting
    with a letter or digit: nothing that could forge a log line or a header."""
    return _SANE.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str | None:
    """The id of the request being served in this context, or None outside a request."""
    return _current.get()


def set_request_id(request_id: str | None) -> None:
    """Make `request_id` the current one in this context (tests, non-HTTP work)."""
    _current.set(request_id)


def _chosen_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name.lower() == _HEADER:
            text = value.decode("latin-1")
            return text if is_sane(text) else new_request_id()
    return new_request_id()


def _with_id(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...],
             request_id: str) -> list[tuple[bytes, bytes]]:
    """`headers` with exactly one X-Request-Id: `request_id`."""
    kept = [(name, value) for name, value in headers if name.lower() != _HEADER]
    return [*kept, (_HEADER, request_id.encode())]


class RequestIdMiddleware:
    """Chooses the request's id, puts it in the request and response headers, and makes it the
    current one while the request is served."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _chosen_id(scope)
        scope = {**scope, "headers": _with_id(scope.get("headers", []), request_id)}
        _current.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": _with_id(message.get("headers", []),
                                                           request_id)}
            await send(message)

        await self.app(scope, receive, send_with_id)


__all__ = ["REQUEST_ID_HEADER", "RequestIdMiddleware", "current_request_id", "is_sane",
           "new_request_id", "set_request_id"]
