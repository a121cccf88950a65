"""HTTP to instances: one pooled `httpx.AsyncClient`, header filtering, error bodies, and the
streaming response that relays an instance's SSE stream to the client.

The relay forwards whole SSE frames only (a chunk is cut after its last blank line; the rest waits
for the next chunk), so when the instance dies mid-stream the client receives well-formed frames
followed by one error event and `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from strata.gateway.config import GatewayConfig
from strata.protocol.sse import DONE_FRAME, encode_event

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
INSTANCE_HEADER = "x-strata-instance"
FRAME_END = b"\n\n"


def create_client(config: GatewayConfig,
                  transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The pooled client for proxied requests. The read timeout bounds the silence between two
    chunks; a connection the instance closed is noticed at once, without waiting for it."""
    timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                            write=config.read_timeout_s, pool=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=config.max_connections,
                          max_keepalive_connections=config.max_connections)
    return httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits)


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones (both directions)."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def error_payload(status_code: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status_code}}


def error_response(status_code: int, message: str, *, kind: str | None = None,
                   retry_after_s: float | None = None) -> Response:
    """A JSON response with the OpenAI error body."""
    kind = kind or _KINDS.get(status_code, "upstream_error")
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else None
    body = json.dumps(error_payload(status_code, message, kind)).encode()
    return Response(body, status_code, headers=headers, media_type="application/json")


_KINDS = {400: "invalid_request_error", 404: "not_found_error", 429: "overloaded_error",
          502: "upstream_error", 503: "service_unavailable_error"}


def split_frames(buffer: bytes) -> tuple[bytes, bytes]:
    """(complete frames, the partial rest)."""
    cut = buffer.rfind(FRAME_END)
    if cut < 0:
        return b"", buffer
    return buffer[: cut + 2], buffer[cut + 2 :]


def broken_stream_frames(message: str) -> bytes:
    """What a client receives when its stream's instance fails: an error event, then [DONE]."""
    return encode_event(error_payload(502, message, "upstream_error")) + DONE_FRAME


class RelayResponse(StreamingResponse):
    """A streamed response that runs `on_close` callbacks once, however the stream ends
    (finished, instance failed, client gone, never sent)."""

    def __init__(self, frames: AsyncIterator[bytes], status_code: int,
                 headers: dict[str, str]) -> None:
        super().__init__(frames, status_code, headers=headers)
        self._frames = frames
        self.on_close: list[Callable[[], None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._frames, "aclose", None)
                if aclose is not None:
                    await aclose()
            for callback in self.on_close:
                callback()


async def read_frames(chunks: AsyncIterator[bytes]) -> tuple[bytes, bytes, bool]:
    """Reads until at least one whole SSE frame arrived: (frames, partial rest, is_eof)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        frames, rest = split_frames(buffer)
        if frames:
            return frames, rest, False
    return buffer, b"", True


async def close_quietly(response: httpx.Response) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await response.aclose()
        except httpx.HTTPError:
            pass


def response_headers(response: httpx.Response, instance_id: str) -> dict[str, str]:
    headers = dict(forwarded_headers(response.headers.items()))
    headers[INSTANCE_HEADER] = instance_id
    return headers


__all__ = ["HOP_BY_HOP", "INSTANCE_HEADER", "RelayResponse", "broken_stream_frames",
           "close_quietly", "create_client", "error_payload", "error_response",
           "forwarded_headers", "read_frames", "response_headers", "split_frames"]
