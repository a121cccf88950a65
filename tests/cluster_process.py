"""`strata up` as a real process for end-to-end tests: start it, find its gateway, stop it.
The process helper (and `wait_until`) is tests/harness/procs.py."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness.procs import Proc, start_up, wait_until

__all__ = ["Cluster", "start_cluster", "wait_until"]


@dataclass
class Cluster:
    process: Proc
    url: str
    run_dir: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.process.output()

    def pids(self) -> dict[str, int]:
        lines = (self.run_dir / "pids").read_text().split("\n")
        return {name: int(pid) for name, pid in (line.split() for line in lines if line)}

    def instances(self) -> dict[str, dict]:
        body = httpx.get(f"{self.url}/admin/instances", timeout=5).json()
        return {i["instance_id"]: i for i in body["instances"]}

    def stop(self) -> int | None:
        """SIGINT (`strata up` stops its children gracefully); its exit code."""
        return self.process.stop(timeout_s=60, sig=signal.SIGINT)


def start_cluster(args: list[str], root: Path, env_extra: dict[str, str] | None = None,
                  timeout_s: float = 300, replicas: int = 3) -> Cluster:
    run_dir = root / "run"
    env = {**os.environ, "STRATA_RUN_DIR": str(run_dir), **(env_extra or {})}
    up = start_up(["--replicas", str(replicas), "--log-level", "warning", *args], run_dir,
                  env=env, timeout_s=timeout_s)
    return Cluster(up, up.url, run_dir)
