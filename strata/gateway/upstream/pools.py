"""HTTP to instances: one connection pool per instance (`UpstreamPools`), header filtering, error
bodies, and the streaming response that relays an instance's SSE stream to the client.

Pools are per instance, so a request's work does not grow with the fleet's connections. An
`http://` instance gets a `ConnectionPool` (strata/gateway/upstream/connection.py: one write per
request, the head parsed by httptools, no scan of the pool's connections); an injected httpx
`transport` (tests) or an `https://` instance gets an httpx transport, called directly (no
client-level auth, redirect or cookie layers). `max_connections` bounds each instance's pool.
A pool is created at an instance's first request and closed once the instance has left the set
(or changed URL) and every response it gave is closed.

The relay forwards whole SSE frames only (a chunk is cut after its last blank line; the rest waits
for the next chunk), so when the instance dies mid-stream the client receives well-formed frames
followed by one error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from strata.gateway.config import GatewayConfig
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.upstream.connection import ConnectionPool
from strata.protocol.errors import error_json, error_payload, retry_after
from strata.protocol.sse import DONE_FRAME, encode_event

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
                        "content-length"})
SERVER_SET = frozenset({"date", "server"})  # set by the gateway's HTTP server on every answer
INSTANCE_HEADER = "x-strata-instance"
FRAME_END = b"\n\n"


class UpstreamAnswer(Protocol):
    """What the proxy reads from an instance's answer: an `httpx.Response` or the lean
    client's `UpstreamResponse`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> HeaderLookup: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class HeaderLookup(Protocol):
    def get(self, name: str, default: str | None = None) -> str | None: ...

    def items(self) -> Iterable[tuple[str, str]]: ...


@dataclass(slots=True)
class _Pool:
    view: InstanceView  # the view it was made for (a new view of that id gets a new pool)
    url: str
    transport: httpx.AsyncBaseTransport | ConnectionPool
    num_open: int = 0  # requests sent whose response is not closed yet

    def closed_one(self) -> None:
        self.num_open -= 1


class _CountedStream(httpx.AsyncByteStream):
    """A response body that tells its pool when it is closed (once)."""

    def __init__(self, inner: httpx.AsyncByteStream, pool: _Pool) -> None:
        self.inner = inner
        self.pool: _Pool | None = pool

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.inner:
                yield chunk
        except (httpx.HTTPError, OSError, RuntimeError):
            raise
        except Exception as exc:  # a connection reset under the transport: see `send`
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self.pool is not None:
            self.pool.num_open -= 1
            self.pool = None
        await self.inner.aclose()


class UpstreamPools:
    """The connection pools for proxied requests, one per instance (an injected `transport`,
    as tests give, serves every instance). The read timeout bounds the silence between two
    chunks; a connection the instance closed is noticed at once, without waiting for it."""

    def __init__(self, config: GatewayConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.timeout = httpx.Timeout(connect=config.connect_timeout_s,
                                     read=config.read_timeout_s, write=config.read_timeout_s,
                                     pool=config.connect_timeout_s).as_dict()
        self.limits = httpx.Limits(max_connections=config.max_connections,
                                   max_keepalive_connections=config.max_connections)
        self.connect_timeout_s = config.connect_timeout_s
        self.read_timeout_s = config.read_timeout_s
        self.shared = transport
        self.pools: dict[str, _Pool] = {}
        self.retired: list[_Pool] = []  # left the set; closed once nothing is in flight
        self._closing: set[asyncio.Task[None]] = set()

    def pool_for(self, view: InstanceView) -> _Pool:
        pool = self.pools.get(view.instance_id)
        if pool is not None and pool.view is view and pool.url == view.url:
            return pool
        if pool is not None:
            self.retired.append(pool)
        transport: httpx.AsyncBaseTransport | ConnectionPool
        if self.shared is not None:
            transport = self.shared
        elif view.url.startswith("http://"):
            transport = ConnectionPool(view.url, max_connections=self.limits.max_connections or 1,
                                       connect_timeout_s=self.connect_timeout_s,
                                       read_timeout_s=self.read_timeout_s)
        else:
            transport = httpx.AsyncHTTPTransport(limits=self.limits)
        pool = self.pools[view.instance_id] = _Pool(view, view.url, transport)
        return pool

    async def send(self, view: InstanceView, method: str, path: str, body: bytes,
                   headers: list[tuple[str, str]]) -> UpstreamAnswer:
        """The instance's response, its body unread (the caller closes it)."""
        pool = self.pool_for(view)
        pool.num_open += 1
        if isinstance(pool.transport, ConnectionPool):
            try:
                answer = await pool.transport.request(method, path, body, headers)
            except BaseException:
                pool.num_open -= 1
                raise
            answer.on_close = pool.closed_one
            return answer
        request = httpx.Request(method, view.url + path, content=body, headers=headers,
                                extensions={"timeout": self.timeout})
        try:
            response = await pool.transport.handle_async_request(request)
        except (httpx.HTTPError, OSError, RuntimeError):
            pool.num_open -= 1
            raise
        except Exception as exc:
            # A connection reset as it opens can surface as another error from the transport
            # (anyio asks a socket already closed for its peer name: AttributeError): it is the
            # connection's failure, never a 500.
            pool.num_open -= 1
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}", request=request) from exc
        except BaseException:
            pool.num_open -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, pool)
        response.request = request
        return response

    def prune(self, instances: InstanceSet) -> None:
        """Retire the pools of instances that left `instances` or changed URL; close retired
        pools with nothing in flight (in the background: closing never delays a request)."""
        for instance_id, pool in list(self.pools.items()):
            if instances.get(instance_id) is not pool.view or pool.view.url != pool.url:
                self.retired.append(self.pools.pop(instance_id))
        idle = [pool for pool in self.retired if pool.num_open == 0]
        self.retired = [pool for pool in self.retired if pool.num_open > 0]
        for pool in idle:
            if pool.transport is self.shared:
                continue
            task = asyncio.get_running_loop().create_task(pool.transport.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Close every pool (at shutdown)."""
        pools = [*self.pools.values(), *self.retired]
        self.pools, self.retired = {}, []
        transports = {id(pool.transport): pool.transport for pool in pools}
        if self.shared is not None:
            transports[id(self.shared)] = self.shared
        for transport in transports.values():
            with anyio.CancelScope(shield=True):
                await transport.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones (both directions)."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def error_response(status_code: int, message: str, *, kind: str | None = None,
                   retry_after_s: float | None = None) -> Response:
    """A JSON response with the OpenAI error body (strata.protocol.errors)."""
    headers = retry_after(retry_after_s) if retry_after_s else None
    return Response(error_json(status_code, message, kind=kind), status_code, headers=headers,
                    media_type="application/json")


def split_frames(buffer: bytes) -> tuple[bytes, bytes]:
    """(complete frames, the partial rest)."""
    cut = buffer.rfind(FRAME_END)
    if cut < 0:
        return b"", buffer
    return buffer[: cut + 2], buffer[cut + 2 :]


def broken_stream_frames(message: str) -> bytes:
    """What a client receives when its stream's instance fails: an error event, then [DONE]."""
    return encode_event(error_payload(502, message)) + DONE_FRAME


class RelayResponse(StreamingResponse):
    """A streamed response that runs `on_close` callbacks once, however the stream ends
    (finished, instance failed, client gone, never sent). A client that disconnects stops the
    stream at once (its upstream answer is closed, so the instance stops too): the frames are
    sent from the request's own task while a second task waits for the disconnect, as
    Starlette does, without the anyio task group it builds around both for every response."""

    def __init__(self, frames: AsyncIterator[bytes], status_code: int,
                 headers: dict[str, str]) -> None:
        super().__init__(frames, status_code, headers=headers)
        self._frames = frames
        self.on_close: list[Callable[[], None]] = []
        self.is_disconnected = False  # the client left before the stream ended

    def relay_through(self, wrap: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]) -> None:
        """Sends the frames through `wrap` (a step that watches them, as the tenants' meter
        reads a stream's usage); `wrap` must close the frames it was given when it is closed."""
        self._frames = wrap(self._frames)
        self.body_iterator = self._frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._frames, "aclose", None)
                if aclose is not None:
                    await aclose()
            for callback in self.on_close:
                callback()


    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        watch = ClientWatch(receive)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not watch.was_only_cause():
                raise
        finally:
            watch.stop()
            self.is_disconnected = watch.has_left


class ClientWatch:
    """Cancels the current task when its client leaves (`receive` answers http.disconnect);
    the task's own code goes on where the cancellation surfaced: after a CancelledError,
    `was_only_cause()` says whether the client's leaving alone caused it (and then uncancels)."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.has_left = False
        self.listener = asyncio.get_running_loop().create_task(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.has_left = True
        self.task.cancel()  # surfaces where the task awaits

    def was_only_cause(self) -> bool:
        if not self.has_left or self.task.cancelling() > 1:  # cancelled from outside too
            return False
        self.task.uncancel()
        return True

    def stop(self) -> None:
        self.listener.cancel()


async def read_frames(chunks: AsyncIterator[bytes]) -> tuple[bytes, bytes, bool]:
    """Reads until at least one whole SSE frame arrived: (frames, partial rest, is_eof)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        frames, rest = split_frames(buffer)
        if frames:
            return frames, rest, False
    return buffer, b"", True


async def close_quietly(response: UpstreamAnswer) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await response.aclose()
        except httpx.HTTPError:
            pass


def response_headers(response: UpstreamAnswer, instance_id: str) -> dict[str, str]:
    """The instance's answer headers as the client gets them: no hop-by-hop ones, and not the
    instance's `date` and `server`, which the gateway's own server sets (once)."""
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in HOP_BY_HOP and k.lower() not in SERVER_SET}
    headers[INSTANCE_HEADER] = instance_id
    return headers


__all__ = ["HOP_BY_HOP", "INSTANCE_HEADER", "ClientWatch", "RelayResponse", "broken_stream_frames",
           "UpstreamAnswer", "UpstreamPools", "close_quietly", "error_response",
           "forwarded_headers", "read_frames", "response_headers", "split_frames"]
