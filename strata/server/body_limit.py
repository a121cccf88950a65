"""ASGI middleware: refuse request bodies larger than a cap with 413; name the model version.

The declared Content-Length is checked before the app runs; a body streamed without one (chunked)
is counted as it arrives and the read fails with `PayloadTooLargeError` once past the cap.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata.errors import PayloadTooLargeError
from strata.server.errors import error_response


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes`, whatever the route."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, size: int | None) -> PayloadTooLargeError:
        got = f"{size} bytes" if size is not None else "more"
        return PayloadTooLargeError(
            f"request body is {got}; the limit is {self.max_body_bytes} bytes "
            "(send a shorter prompt or raise --max-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await error_response(self._too_large(declared))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large(None)
            return message

        await self.app(scope, limited_receive, send)


class ModelVersionHeader:
    """Every response says which model version answered: `X-Model-Version: name@version`."""

    def __init__(self, app: ASGIApp, value: str) -> None:
        self.app = app
        self.header = (b"x-model-version", value.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


__all__ = ["BodyLimitMiddleware", "ModelVersionHeader"]
