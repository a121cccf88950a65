"""A real redis-server for tests and benchmarks, on 127.0.0.1 with a directory of its own.

    server = RedisServer(directory, binary, extra_args=["--appendonly", "yes"])
    server.start(); server.url; server.restart(kill=True); server.stop()

It is ready when it answers INFO with its own process id, so a server of someone else's that
holds the port is never taken for ours. A start whose port was taken meanwhile (found free,
then bound by another process before redis-server could) is retried: on a fresh port for a
first start, on the same port once it has served (its clients hold its URL).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from harness.procs import Proc, wait_until
from strata.cluster.ports import free_port, port_is_free
from strata.state.redis_db import find_redis_server


def serving_pid(port: int) -> int | None:
    """The process id of the Redis answering on 127.0.0.1:`port`, or None if none answers."""
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 0))  # one try: the caller polls
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


class RedisServer:
    """One redis-server process; `restart()` keeps its port and directory (for crash tests).
    Without `extra_args` it keeps nothing on disk (no RDB snapshots, no append-only file)."""

    def __init__(self, directory: Path, binary: Path, *, port: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.directory = directory
        self.binary = binary
        self.port = port or free_port()
        self.is_port_fixed = port is not None
        self.extra_args = list(extra_args)
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        return [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.directory), "--logfile", "",
                *self.extra_args]  # later arguments override earlier ones

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server and wait until it answers; another port if this one was taken."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            if self._start_once(timeout_s):
                self.is_port_fixed = True  # clients know its URL from now on
                return
            if self.is_port_fixed:  # the clients hold this port: wait for it
                wait_until(lambda: port_is_free(self.port), timeout_s, f"port {self.port}")
            else:
                self.port = free_port()
        raise RuntimeError(f"redis-server kept losing its port; see {self.directory}/redis.log")

    def _start_once(self, timeout_s: float) -> bool:
        """True once it answers; False if another process held the port."""
        proc = self.proc = Proc("redis-server", self._argv(), self.directory / "redis.log")
        proc.start()
        try:
            proc.wait_until(lambda: serving_pid(self.port) == proc.pid, timeout_s,
                            f"redis-server to answer on port {self.port}")
        except RuntimeError:
            if not proc.lost_its_port:
                raise
            self.proc = None
            return False
        return True

    def stop(self, *, kill: bool = False) -> None:
        """Stop by PID: SIGTERM (SIGKILL with kill=True: a crash); waits for the exit."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.stop(timeout_s=10)
        self.proc = None

    def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same port with the same directory."""
        self.stop(kill=kill)
        self.start()


__all__ = ["RedisServer", "find_redis_server", "serving_pid"]
