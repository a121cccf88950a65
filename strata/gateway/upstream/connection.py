"""A lean HTTP/1.1 client for proxied requests to one instance (`ConnectionPool`): an asyncio
protocol with httptools' response parser, kept-alive connections reused last-in first-out.

What it does per request: one `write` (request head and body together), the head parsed in C,
and the body handed to the relay as it arrives, chunks that arrived together joined into one.
What it leaves out, against httpx + httpcore: scanning every pooled connection at each request
start and end (a `poll` per idle connection), anyio's stream and cancel-scope layers, and the
client's URL, header and byte-stream wrappers.

It raises httpx's exceptions (`ConnectError`, `ConnectTimeout`, `PoolTimeout`, `ReadTimeout`,
`RemoteProtocolError`, `ReadError`), so the proxy's retry and failure rules read the same. A
kept-alive connection the instance closed while idle is noticed when its close arrives; a request
sent on one that closed without answering is sent once more on a new connection. The read timeout
bounds the response head and the silence between two body chunks, as httpx's does.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

import httptools
import httpx

from strata.gateway.upstream.answer import ResponseHeaders, UpstreamResponse

MAX_BUFFERED = 1 << 16  # bytes read ahead of the relay before reading pauses


class _Connection(asyncio.Protocol):
    """One kept-alive connection; parser callbacks fill the response in progress."""

    def __init__(self, pool: ConnectionPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.is_closed = False
        self.is_paused = False
        self.keep_alive = True
        self.is_until_close = False  # the body ends when the connection does

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response.fail(httpx.RemoteProtocolError(f"invalid HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        response = self.response
        if response is not None and exc is None and self.is_until_close and response.head.done():
            self.keep_alive = False
            self.on_message_complete()
        elif response is not None:
            what = "without sending a response" if not response.head.done() else \
                "without sending the complete body"
            error = httpx.RemoteProtocolError(f"the instance closed the connection {what}")
            response.fail(httpx.ReadError(str(exc)) if exc is not None else error)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status_code = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        framed = any(name.lower() in (b"content-length", b"transfer-encoding")
                     for name, _ in response.raw_headers)
        self.is_until_close = not framed and response.status_code not in (204, 304)
        if not response.head.done():
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response.chunks.append(body)
        response.num_buffered += len(body)
        if response.num_buffered > MAX_BUFFERED and not self.is_paused and self.transport:
            self.is_paused = True
            self.transport.pause_reading()
        response.wake()

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response.is_complete = True
        self.response = None
        response.wake()

    @property
    def read_timeout_s(self) -> float:
        return self.pool.read_timeout_s

    def release(self, *, is_reusable: bool) -> None:
        self.pool.release(self, is_reusable=is_reusable)

    def resume_reading(self) -> None:
        if self.is_paused and self.transport is not None and not self.is_closed:
            self.is_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()


class ConnectionPool:
    """Kept-alive connections to one `http://host:port[/prefix]`, at most `max_connections`;
    a request past the bound waits `pool_timeout_s` for one to come back."""

    def __init__(self, url: str, *, max_connections: int, connect_timeout_s: float,
                 read_timeout_s: float) -> None:
        parsed = httpx.URL(url)
        self.host = parsed.host
        self.port = parsed.port or 80
        self.prefix = parsed.raw_path.rstrip(b"/").decode("latin-1") if parsed.raw_path != b"/" \
            else ""
        self.host_header = f"host: {parsed.netloc.decode('latin-1')}\r\n"
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle: list[_Connection] = []
        self.num_connections = 0
        self.waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self.is_closed = False

    async def request(self, method: str, path: str, body: bytes,
                      headers: list[tuple[str, str]]) -> UpstreamResponse:
        """The answer once its head arrived; the caller reads the body and closes it."""
        lines = [f"{method} {self.prefix}{path} HTTP/1.1\r\n", self.host_header]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        if body:
            lines.append(f"content-length: {len(body)}\r\n")
        lines.append("\r\n")
        data = "".join(lines).encode("latin-1") + body
        while True:
            connection, is_reused = await self._acquire()
            response = UpstreamResponse(connection)
            connection.response = response
            assert connection.transport is not None
            connection.transport.write(data)
            timer = connection.loop.call_later(self.read_timeout_s, _time_out_head, response)
            try:
                await response.head
            except (httpx.RemoteProtocolError, httpx.ReadError):
                self.release(connection, is_reusable=False)
                if is_reused and connection.is_closed and not response.raw_headers:
                    continue  # it closed while idle: never read, so send it again
                raise
            except BaseException:
                self.release(connection, is_reusable=False)
                raise
            finally:
                timer.cancel()
            return response

    async def _acquire(self) -> tuple[_Connection, bool]:
        while self.idle:
            connection = self.idle.pop()
            if not connection.is_closed:
                return connection, True
            self.num_connections -= 1
        if self.num_connections >= self.max_connections:
            waiter: asyncio.Future[_Connection | None] = \
                asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                handed = await asyncio.wait_for(waiter, self.connect_timeout_s)
            except TimeoutError:
                raise httpx.PoolTimeout("no connection to the instance came free") from None
            if handed is not None:
                return handed, True
        self.num_connections += 1
        try:
            return await self._connect(), False
        except BaseException:
            self.num_connections -= 1
            self._hand_over(None)
            raise

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, loop), self.host, self.port),
                self.connect_timeout_s)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") \
                from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from None
        return connection

    def release(self, connection: _Connection, *, is_reusable: bool) -> None:
        """Back to the pool (or to a waiting request) if reusable, else closed."""
        connection.response = None
        if is_reusable and not connection.is_closed and not self.is_closed:
            if not self._hand_over(connection):
                self.idle.append(connection)
            return
        connection.close()
        self.num_connections -= 1
        self._hand_over(None)  # a waiting request may open a connection now

    def _hand_over(self, connection: _Connection | None) -> bool:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return True
        return False

    async def aclose(self) -> None:
        """Closes the idle connections; one in use closes when its response does."""
        self.is_closed = True
        for connection in self.idle:
            connection.close()
        self.num_connections -= len(self.idle)
        self.idle = []


def _time_out_head(response: UpstreamResponse) -> None:
    if not response.head.done():
        response.head.set_exception(httpx.ReadTimeout("timed out waiting for the instance"))


__all__ = ["ConnectionPool", "ResponseHeaders", "UpstreamResponse"]
