"""A real `strata gateway` subprocess on a free loopback port (instances: serve_process)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field

from cluster_process import kill_after

_READY = re.compile(r"Strata gateway on (http://127\.0\.0\.1:\d+) \(ready in")


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_gateway(args: list[str], *, timeout_s: float = 60) -> GatewayProcess:
    """Start `strata gateway ARGS --port 0`; returns once it printed its ready line."""
    cmd = [sys.executable, "-m", "strata.cli", "gateway", *args, "--port", "0",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    timer = kill_after(proc, timeout_s)
    try:
        while line := proc.stdout.readline():
            lines.append(line)
            if m := _READY.search(line):
                return GatewayProcess(proc, m.group(1), lines)
    finally:
        timer.cancel()
    proc.wait()
    raise AssertionError("strata gateway did not start:\n" + "".join(lines[-40:]))
