"""Real instance servers behind cuttable TCP relays, and a real gateway, all on 127.0.0.1.

`Relay.kill()` drops every connection and stops listening, which looks to the gateway like an
instance killed with SIGKILL (connections reset, new ones refused); `Relay.restart()` listens on
the same port again (the instance behind it never stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from live_server import LiveServer, serve_in_thread
from starlette.applications import Starlette

from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.sources import StaticSource

NO_ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"))


def free_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class Relay:
    """A TCP relay 127.0.0.1:port -> target_port, one thread per direction per connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restart()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        listener = free_socket(self.port)
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def kill(self) -> None:
        """Reset every connection and stop listening."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00"
                                b"\x00\x00")
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@dataclass
class ServedApp:
    """An ASGI app served by uvicorn in a thread."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_app(app: Starlette) -> ServedApp:
    sock = free_socket()
    port = sock.getsockname()[1]
    server, thread = serve_in_thread(app, sock, timeout_graceful_shutdown=5)
    return ServedApp(server, thread, f"http://127.0.0.1:{port}")


def gateway_config(flags: Sequence[str], env: CliEnv = NO_ENV) -> GatewayConfig:
    """The config `strata gateway FLAGS` builds (the command's own parser and build_config)."""
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    return gateway_command.build_config(parser.parse_args(["gateway", *flags]), env)


def serve_gateway(flags: Sequence[str], env: CliEnv = NO_ENV) -> ServedApp:
    """A gateway as `strata gateway --port 0 FLAGS` builds it (with `--instances`), served on a
    real socket; the caller stops it."""
    config = gateway_config(["--port", "0", *flags], env)
    control = httpx.AsyncClient(timeout=1.0)
    return serve_app(create_gateway_app(config, StaticSource(config.instance_urls, control),
                                        control_client=control))


@dataclass
class Fleet:
    """Instances, each behind a relay, and the gateway in front of the relays."""

    servers: list[LiveServer]
    relays: list[Relay]
    gateway: ServedApp | None = None
    gates: list[object] = field(default_factory=list)

    def stop(self) -> None:
        for gate in self.gates:
            gate.open()  # type: ignore[attr-defined]
        if self.gateway is not None:
            self.gateway.stop()
        for relay in self.relays:
            relay.kill()
        for server in self.servers:
            server.stop()
