"""A loopback TCP proxy that injects faults between a gateway and an instance (chaos tests and
bench/chaos.py): added latency, connections reset, forwarding stopped without closing anything
(what a frozen or partitioned instance looks like), refusal.

    proxy = ChaosProxy(target_port).start()   # its own thread and event loop; proxy.url
    proxy.latency_s = 0.05                    # every chunk, each way, waits this long
    proxy.pause()                             # stop forwarding; connections stay open
    proxy.unpause()                           # forward again (what was held goes through)
    proxy.reset_all()                         # RST every open connection (new ones work)
    proxy.reset_probability = 0.1             # reset each new connection with this chance
    proxy.stop()                              # close everything and stop listening

Only 127.0.0.1. Counters (`num_connections`, `num_resets`) say what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, field

CHUNK_BYTES = 65536


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class ChaosProxy:
    """127.0.0.1:port -> 127.0.0.1:target_port with faults (see the module docstring)."""

    def __init__(self, target_port: int, port: int = 0, *, seed: int = 0) -> None:
        self.target_port = target_port
        self.port = port
        self.latency_s = 0.0
        self.reset_probability = 0.0
        self.num_connections = 0
        self.num_resets = 0
        self._rng = random.Random(seed)
        self._flowing = threading.Event()
        self._flowing.set()
        self._pairs: set[_Pair] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ChaosProxy:
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the chaos proxy did not start")
        return self

    def pause(self) -> None:
        """Stop forwarding bytes both ways; every connection stays open, new ones are accepted
        (the kernel's backlog, as for a frozen process)."""
        self._flowing.clear()

    def unpause(self) -> None:
        self._flowing.set()

    def reset_all(self) -> None:
        """Reset every open connection (SO_LINGER 0: the peer gets RST)."""
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(10)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._flowing.set()
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(writer)
            return
        pair = _Pair(writer, up_writer)
        if self._rng.random() < self.reset_probability:
            self.num_resets += 1
            _reset(writer)
            _reset(up_writer)
            return
        self._pairs.add(pair)
        pair.tasks = [asyncio.create_task(self._pump(reader, up_writer)),
                      asyncio.create_task(self._pump(up_reader, writer))]
        await asyncio.gather(*pair.tasks, return_exceptions=True)
        self._pairs.discard(pair)
        for side in (writer, up_writer):  # both directions ended: close, or the socket leaks
            side.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                while not self._flowing.is_set():
                    await asyncio.sleep(0.01)
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if writer.can_write_eof():
                    writer.write_eof()

    async def _reset_all(self) -> None:
        for pair in list(self._pairs):
            self.num_resets += 1
            for task in pair.tasks:
                task.cancel()
            _reset(pair.client)
            _reset(pair.upstream)
        self._pairs.clear()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


__all__ = ["ChaosProxy"]
