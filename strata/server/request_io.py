"""What the route modules share about reading a request and sending a stream.

`parse_body` turns the JSON body into a protocol model (anything else is a 400 through the error
table); `unless_disconnected` cancels work, and so aborts its engine requests, when the client
leaves; `SSEResponse` streams frames and runs a close hook however the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from strata.protocol.json_body import parse_json_object
from strata.protocol.priority import MAX_PRIORITY_STATE, PRIORITY_HEADER, effective_priority

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON body -> model; a body that is not a JSON object (strata/protocol/json_body.py) and
    wrong types raise (mapped to 400)."""
    return model.model_validate(parse_json_object(await request.body()))


def request_priority(request: Request, body_priority: object) -> int:
    """`X-Priority`, else the body's `priority`, else standard; clamped to the API key's
    ceiling (strata/protocol/priority.py)."""
    ceiling = request.scope.get("state", {}).get(MAX_PRIORITY_STATE)
    return effective_priority(request.headers.get(PRIORITY_HEADER), body_priority, ceiling)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnect()
    finally:
        task.cancel()


class SSEResponse(StreamingResponse):
    """Streams SSE frames; whatever ends the stream (done, error, client gone) runs `on_close`."""

    def __init__(self, frames: AsyncGenerator[bytes, None],
                 on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._frames = frames
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self._frames.aclose()
            await self._on_close()


__all__ = ["SSEResponse", "parse_body", "unless_disconnected"]
