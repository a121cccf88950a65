"""The gateway's lean HTTP/1.1 client (strata/gateway/upstream/connection.py) against real sockets:
a raw asyncio server on 127.0.0.1 that answers exactly what each test scripts, so reuse, a close
while idle, timeouts, the pool bound and broken bodies are all observable on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from strata.gateway.upstream.connection import ConnectionPool

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


class Server:
    """Counts connections and requests; `answer(reader, writer, n)` answers the n-th request
    of the server and says whether to keep the connection open."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                try:
                    self.requests.append(await read_request(reader))
                except asyncio.IncompleteReadError:
                    return
                if not await self.answer(reader, writer, len(self.requests)):
                    return
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def pool(url: str, *, max_connections: int = 10, read_timeout_s: float = 5.0) -> ConnectionPool:
    return ConnectionPool(url, max_connections=max_connections, connect_timeout_s=1.0,
                          read_timeout_s=read_timeout_s)


async def json_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    body = b'{"n": %d}' % n
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    return True


def test_a_request_is_one_write_with_host_and_length_and_the_connection_is_reused() -> None:
    async def run() -> None:
        server = Server(json_ok)
        url = await server.start()
        upstream = pool(url + "/prefix")
        for n in (1, 2):
            response = await upstream.request("POST", "/v1/x", b'{"a": 1}',
                                              [("x-request-id", "r1")])
            assert response.status_code == 200
            assert response.headers.get("Content-Type") == "application/json"
            assert await response.aread() == b'{"n": %d}' % n
            await response.aclose()
        assert server.num_connections == 1 and upstream.num_connections == 1
        head = server.requests[0].decode()
        assert head.startswith("POST /prefix/v1/x HTTP/1.1\r\n")
        assert f"host: {url.removeprefix('http://')}\r\n" in head
        assert "x-request-id: r1\r\ncontent-length: 8\r\n\r\n{\"a\": 1}" in head
        await upstream.aclose()
        await server.stop()

    asyncio.run(run())


def test_a_connection_the_instance_closed_while_idle_fails_no_request() -> None:
    async def close_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          n: int) -> bool:
        await json_ok(reader, writer, n)
        return False  # the server closes the kept-alive connection after its answer

    async def run() -> None:
        server = Server(close_after)
        upstream = pool(await server.start())
        for n in (1, 2, 3):
            response = await upstream.request("GET", "/", b"", [])
            assert await response.aread() == b'{"n": %d}' % n
            await response.aclose()  # the close may or may not have arrived: noticed or resent
        assert server.num_connections == 3
        await upstream.aclose()
        await server.stop()

    asyncio.run(run())


def test_a_streamed_body_arrives_in_order_and_a_silence_is_a_read_timeout() -> None:
    release = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await release.wait()
        return False

    async def run() -> None:
        server = Server(stream)
        upstream = pool(await server.start(), read_timeout_s=0.2)
        response = await upstream.request("POST", "/", b"{}", [])
        assert response.headers.get("content-type") == "text/event-stream"
        chunks = response.aiter_raw()
        assert await anext(chunks) == b"data: 1\n\n"
        with pytest.raises(httpx.ReadTimeout):
            await anext(chunks)
        await response.aclose()  # not read to its end: closed, not kept
        assert upstream.num_connections == 0 and upstream.idle == []
        release.set()
        await server.stop()

    asyncio.run(run())


def test_an_instance_that_dies_mid_body_is_a_remote_protocol_error() -> None:
    async def die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        return False  # closed without the last chunk

    async def run() -> None:
        server = Server(die)
        upstream = pool(await server.start())
        response = await upstream.request("POST", "/", b"{}", [])
        received = []
        with pytest.raises(httpx.RemoteProtocolError, match="complete body"):
            async for piece in response.aiter_raw():
                received.append(piece)
        assert received == [b"data: 1\n\n"]
        await response.aclose()
        assert upstream.num_connections == 0
        await server.stop()

    asyncio.run(run())


def test_a_refused_connection_is_a_connect_error() -> None:
    async def run() -> None:
        server = Server(json_ok)
        url = await server.start()
        await server.stop()
        assert server.server is not None
        await server.server.wait_closed()
        upstream = pool(url)
        with pytest.raises(httpx.ConnectError):
            await upstream.request("GET", "/", b"", [])
        assert upstream.num_connections == 0

    asyncio.run(run())


def test_past_the_bound_a_request_waits_for_a_connection_then_times_out() -> None:
    async def run() -> None:
        server = Server(json_ok)
        upstream = pool(await server.start(), max_connections=1)
        upstream.connect_timeout_s = 0.2
        first = await upstream.request("GET", "/", b"", [])
        waiting = asyncio.ensure_future(upstream.request("GET", "/", b"", []))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await first.aread() == b'{"n": 1}'
        await first.aclose()  # hands its connection to the waiting request
        second = await waiting
        assert await second.aread() == b'{"n": 2}'
        assert server.num_connections == 1
        with pytest.raises(httpx.PoolTimeout):  # `second` still holds the only connection
            await upstream.request("GET", "/", b"", [])
        await second.aclose()
        await upstream.aclose()
        await server.stop()

    asyncio.run(run())


def test_a_body_without_length_ends_with_the_connection() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()
        return False

    async def run() -> None:
        server = Server(until_close)
        upstream = pool(await server.start())
        response = await upstream.request("GET", "/", b"", [])
        assert await response.aread() == b"all of it"
        await response.aclose()
        assert upstream.num_connections == 0  # not kept: the body ended with the connection
        await server.stop()

    asyncio.run(run())
