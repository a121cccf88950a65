"""Fakes for gateway tests: instance views, a settable clock, a fixed source, scripted upstreams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from strata.gateway.routing.instances import InstanceSet, InstanceView, ReportedLoad


def view(instance_id: str, model: str = "m", *, running: int = 0, waiting: int = 0,
         **fields: Any) -> InstanceView:
    """A ready instance view at http://{id}."""
    return InstanceView(instance_id, f"http://{instance_id}", model,
                        reported=ReportedLoad(running, waiting), **fields)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FixedSource:
    """An instance source whose set the test edits by hand."""

    def __init__(self, *views: InstanceView) -> None:
        self.instances = InstanceSet(views)
        self.num_refreshes = 0

    async def refresh(self) -> None:
        self.num_refreshes += 1


class ChunkStream(httpx.AsyncByteStream):
    """Yields `chunks` like a socket would (unread, unlike `content=`); with `breaks`, then fails
    like a connection the peer dropped."""

    def __init__(self, chunks: list[bytes], *, breaks: bool = False) -> None:
        self.chunks = chunks
        self.breaks = breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.RemoteProtocolError("peer closed connection without sending "
                                            "complete body")


Handler = Callable[[httpx.Request], httpx.Response]


def json_answer(data: Any, status_code: int = 200) -> httpx.Response:
    return httpx.Response(status_code, stream=ChunkStream([json.dumps(data).encode()]),
                          headers={"content-type": "application/json"})


def sse_answer(*frames: bytes, breaks: bool = False) -> httpx.Response:
    stream = ChunkStream(list(frames), breaks=breaks)
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


class Upstreams:
    """A MockTransport handler: per host, a function answering requests; records every call."""

    def __init__(self, **hosts: Handler) -> None:
        self.hosts = hosts
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.calls.append((host, request.url.path))
        handler = self.hosts.get(host)
        if handler is None:
            raise httpx.ConnectError("connection refused", request=request)
        return handler(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)
