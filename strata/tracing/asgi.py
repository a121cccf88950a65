"""The server span of each HTTP request, on the gateway and on the instance.

`TraceRequests` is plain ASGI (not Starlette's `BaseHTTPMiddleware`, which would run the route in
another task and lose the span's context): the span is current while the route runs and while
its response is sent, so a streamed answer's relay, resumes included, is inside it. Its parent
is the request's `traceparent` (the client's at the gateway, the gateway's attempt at an
instance). Health, metrics and other paths not in `traced_prefixes` pass through untraced.
A span is named after its route (`route_of`: a path with an id in it, such as a hand-off's
block handle, names its template, so that span names stay few); `url.path` keeps the path.
Apps install it only when tracing is on (`is_on()` at build time).
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata.protocol.request_id import REQUEST_ID_HEADER
from strata.tracing.setup import current
from strata.tracing.spans import extract

_REQUEST_ID = REQUEST_ID_HEADER.encode()


class TraceRequests:
    """One server span per traced request: `<component> <path>` with its status code."""

    def __init__(self, app: ASGIApp, *, component: str, traced_prefixes: tuple[str, ...],
                 attributes: dict[str, str] | None = None,
                 route_of: Callable[[str], str] = str) -> None:
        self.app = app
        self.route_of = route_of
        self.component = component  # "strata.gateway" or "strata.instance"
        self.traced_prefixes = traced_prefixes
        self.attributes = attributes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = current.tracer
        path = scope.get("path", "")
        if tracer is None or scope["type"] != "http" or not path.startswith(self.traced_prefixes):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        request_id = next((v.decode("latin-1") for k, v in headers if k.lower() == _REQUEST_ID),
                          None)
        attributes = {**self.attributes, "http.request.method": scope.get("method", ""),
                      "url.path": path}
        if request_id is not None:
            attributes["strata.request_id"] = request_id
        with tracer.start_as_current_span(f"{self.component} {self.route_of(path)}",
                                          context=extract(headers),
                                          kind=SpanKind.SERVER, attributes=attributes) as opened:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    opened.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, send_noting_status)


__all__ = ["TraceRequests"]
