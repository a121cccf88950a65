"""`strata up` as a real process for end-to-end tests: start it, find its gateway, stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from strata.cluster.local import free_port


@dataclass
class Cluster:
    proc: subprocess.Popen[str]
    url: str
    run_dir: Path
    output: list[str] = field(default_factory=list)

    def pids(self) -> dict[str, int]:
        lines = (self.run_dir / "pids").read_text().split("\n")
        return {name: int(pid) for name, pid in (line.split() for line in lines if line)}

    def instances(self) -> dict[str, dict]:
        body = httpx.get(f"{self.url}/admin/instances", timeout=5).json()
        return {i["instance_id"]: i for i in body["instances"]}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)


def start_cluster(args: list[str], root: Path, env_extra: dict[str, str] | None = None,
                  timeout_s: float = 300, replicas: int = 3) -> Cluster:
    port = free_port()
    run_dir = root / "run"
    env = {**os.environ, "STRATA_RUN_DIR": str(run_dir), **(env_extra or {})}
    cmd = [sys.executable, "-m", "strata.cli", "up", "--replicas", str(replicas), "--port",
           str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout is not None
    timer = kill_after(proc, timeout_s)
    lines: list[str] = []
    try:
        while line := proc.stdout.readline():
            lines.append(line)
            if m := re.search(r"instances? .*behind (http://127\.0\.0\.1:\d+)", line):
                return Cluster(proc, m.group(1), run_dir, lines)
    finally:
        timer.cancel()
    raise AssertionError("strata up did not start:\n" + "".join(lines[-30:]))


def kill_after(proc: subprocess.Popen[str], timeout_s: float) -> Any:
    timer = threading.Timer(timeout_s, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until true; returns the seconds it took (bounded: never hangs)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start
