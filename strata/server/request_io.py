"""What the route modules share about answering a request (reading one is preamble.py's).

`unless_cancelled` (cancel.py) cancels work, and so aborts its engine requests, when the client
leaves or the deadline passes; `SSEResponse` streams frames until the deadline and runs a close
hook however the stream ends, counting a stream its client left.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from strata.server.cancel import CLIENT_DISCONNECT, Cancel, cancel_of, unless_cancelled


class SSEResponse(StreamingResponse):
    """Streams SSE frames of `request` until its deadline (then an error event); whatever ends
    the stream (done, error, deadline, client gone) runs `on_close`."""

    def __init__(self, request: Request, frames: AsyncGenerator[bytes, None],
                 on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        self._cancel = cancel_of(request)
        # no deadline: the frames as they are (nothing added per frame)
        self._frames = frames if self._cancel.deadline_s is None else self._cancel.frames(frames)
        self._is_over = False  # the frames ended by themselves (not cut off by the client)
        super().__init__(self._watched(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._on_close = on_close

    async def _watched(self) -> AsyncGenerator[bytes, None]:
        try:
            async for frame in self._frames:
                yield frame
        except Exception:
            self._is_over = True
            raise
        self._is_over = True

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            if not self._is_over:
                self._cancel.note(CLIENT_DISCONNECT)
            await self._frames.aclose()
            await self._on_close()


__all__ = ["Cancel", "SSEResponse", "unless_cancelled"]
