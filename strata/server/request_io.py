"""What the route modules share about answering a request (reading one is preamble.py's).

`unless_disconnected` cancels work, and so aborts its engine requests, when the client leaves;
`SSEResponse` streams frames and runs a close hook however the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Send

T = TypeVar("T")


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


__all__ = ["SSEResponse", "unless_disconnected"]
