"""An instance's answer as the lean client (strata/gateway/upstream/connection.py) hands it over:
status and headers once the head arrived, then the body chunk by chunk as the relay asks, chunks
that arrived together joined into one."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import httpx


class Carrier(Protocol):
    """The connection an answer arrives on."""

    loop: asyncio.AbstractEventLoop
    keep_alive: bool

    @property
    def read_timeout_s(self) -> float: ...

    def resume_reading(self) -> None: ...

    def release(self, *, is_reusable: bool) -> None: ...


class ResponseHeaders:
    """The answer's headers, as much of `httpx.Headers` as the proxy reads (lower-case names;
    repeated ones joined with ", ")."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        values = [value.decode("latin-1") for k, value in self.raw if k.lower() == key]
        return ", ".join(values) if values else default

    def items(self) -> list[tuple[str, str]]:
        merged: dict[str, str] = {}
        for name, value in self.raw:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            merged[key] = f"{merged[key]}, {text}" if key in merged else text
        return list(merged.items())


class UpstreamResponse:
    """One answer of an instance, its body read as the caller iterates `aiter_raw`. `aclose`
    gives the connection back when the body was read to its end, else closes it."""

    def __init__(self, connection: Carrier) -> None:
        self.connection = connection
        self.status_code = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers = ResponseHeaders(self.raw_headers)
        self.head: asyncio.Future[None] = connection.loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.num_buffered = 0
        self.is_complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.is_closed = False
        self.on_close: Callable[[], None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        if not self.head.done():
            self.head.set_exception(error)
            return
        if not self.is_complete and self.error is None:
            self.error = error
            self.wake()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        connection = self.connection
        while True:
            if self.chunks:
                chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.num_buffered = 0
                connection.resume_reading()
                yield chunk
            elif self.error is not None:
                raise self.error
            elif self.is_complete:
                return
            else:
                await self._wait()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def _wait(self) -> None:
        loop = self.connection.loop
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(self.connection.read_timeout_s, _time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    async def aclose(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self.on_close is not None:
            self.on_close()
        connection = self.connection
        connection.release(is_reusable=self.is_complete and self.error is None
                           and connection.keep_alive)


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("timed out waiting for the instance"))


__all__ = ["Carrier", "ResponseHeaders", "UpstreamResponse"]
