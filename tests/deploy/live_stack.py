"""A real `strata gateway` subprocess on a free loopback port (instances: serve_process), and
the traffic the deploy tests send through it."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import httpx

_READY = re.compile(r"Strata gateway on (http://127\.0\.0\.1:\d+) \(ready in")


def kill_after(proc: subprocess.Popen[str], timeout_s: float) -> threading.Timer:
    """SIGKILL `proc` after `timeout_s` unless the returned timer is cancelled first."""
    timer = threading.Timer(timeout_s, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


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


def drive_traffic(gateway_url: str, model: str) -> None:
    """One answer, the same again (a response cache hit: the model names its version, which
    the cache key needs), a stream, a malformed request."""
    body = {"model": f"{model}@v1", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=gateway_url, timeout=30) as client:
        first = client.post("/v1/chat/completions", json=body)
        again = client.post("/v1/chat/completions", json=body)
        assert first.status_code == again.status_code == 200, first.text
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        bad = client.post("/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
        assert bad.status_code == 400
