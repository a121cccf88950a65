"""A highly available Redis on 127.0.0.1 for tests and benchmarks: a primary, two replicas and
three Sentinels, every one a real redis-server process (Sentinels are `redis-server --sentinel`).

    group = SentinelGroup(directory, binary); group.start()
    group.url            # redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/strata/0
    old = group.kill_primary(); group.wait_for_failover(old)   # seconds until a new primary
    group.stop()

The Sentinels call a primary down after `down_after_ms` without an answer and need two of three
to agree (quorum 2); the failover promotes the replica with the most replicated data and points
the other replica at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from harness.procs import Proc, wait_until
from harness.redis_server import RedisServer, serving_pid
from strata.cluster.ports import free_port


def _ask(port: int, *command: str) -> Any:
    """One command to the server or Sentinel on `port`, one try, the connection closed."""
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                         decode_responses=True, retry=Retry(NoBackoff(), 0))
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _role(port: int) -> str | None:
    try:
        return str(_ask(port, "ROLE")[0])
    except (redis.RedisError, OSError):
        return None


def _link_up(port: int) -> bool:
    try:
        return _ask(port, "INFO", "replication").get("master_link_status") == "up"
    except (redis.RedisError, OSError):
        return False


class SentinelGroup:
    def __init__(self, directory: Path, binary: Path, *, service: str = "strata",
                 down_after_ms: int = 1000) -> None:
        self.directory = directory
        self.binary = binary
        self.service = service
        self.down_after_ms = down_after_ms
        self.servers: list[RedisServer] = []
        self.sentinel_ports: list[int] = []
        self.sentinels: list[Proc] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        primary = RedisServer(self.directory / "server0", self.binary)
        primary.start()
        self.servers = [primary]
        for n in (1, 2):
            replica = RedisServer(self.directory / f"server{n}", self.binary, extra_args=[
                "--replicaof", "127.0.0.1", str(primary.port)])
            replica.start()
            self.servers.append(replica)
        for replica in self.servers[1:]:
            wait_until(lambda r=replica: _link_up(r.port),  # type: ignore[misc]
                       timeout_s, f"replica {replica.port} in sync")
        for n in range(3):
            self._start_sentinel(n, primary.port)
        wait_until(self._sentinels_agree, timeout_s, "three Sentinels that see each other and "
                   "both replicas")

    def _start_sentinel(self, n: int, primary_port: int) -> None:
        directory = self.directory / f"sentinel{n}"
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        config = directory / "sentinel.conf"  # a Sentinel rewrites its config: a file of its own
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 10000\n"
            f"sentinel parallel-syncs {self.service} 2\n")
        proc = Proc(f"redis-sentinel-{n}", [str(self.binary), str(config), "--sentinel"],
                    directory / "sentinel.log")
        proc.start()
        proc.wait_until(lambda: serving_pid(port) == proc.pid, 20.0,
                        f"redis-sentinel to answer on port {port}")
        self.sentinel_ports.append(port)
        self.sentinels.append(proc)

    def _sentinels_agree(self) -> bool:
        for port in self.sentinel_ports:
            try:
                master = _ask(port, "SENTINEL", "MASTER", self.service)
            except (redis.RedisError, OSError):
                return False
            fields = master  # redis-py parses the reply into a dict
            if int(fields["num-slaves"]) < 2 or int(fields["num-other-sentinels"]) < 2:
                return False
        return True

    def primary_port(self) -> int | None:
        """The primary's port as a Sentinel that answers sees it."""
        for port in self.sentinel_ports:
            try:
                addr = _ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            except (redis.RedisError, OSError):
                continue
            if addr:
                return int(addr[1])
        return None

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def kill_primary(self) -> int:
        """SIGKILL the primary (a crash); returns its port."""
        port = self.primary_port()
        assert port is not None, "no Sentinel names a primary"
        self.server_on(port).stop(kill=True)
        return port

    def wait_for_failover(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Seconds until a Sentinel names a primary other than `old_port` that answers as a
        primary."""
        def promoted() -> bool:
            port = self.primary_port()
            return port is not None and port != old_port and _role(port) == "master"

        return wait_until(promoted, timeout_s, f"a Sentinel failover away from port {old_port}")

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.stop(timeout_s=10)
        for server in self.servers:
            server.stop()
        self.sentinels, self.servers = [], []


__all__ = ["SentinelGroup"]
