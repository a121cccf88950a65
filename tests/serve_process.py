"""`strata serve` as a real subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_READY = re.compile(r"Strata serving (\S+) on (http://127\.0\.0\.1:\d+) \(ready in")


@dataclass
class ServeProcess:
    proc: subprocess.Popen[str]
    url: str
    served_name: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_serve(args: list[str], *, cache_dir: Path, timeout_s: float = 600) -> ServeProcess:
    """Start `strata serve ARGS --port 0`; returns once it printed its ready line.

    `timeout_s` bounds the wait (the first start may download the default model)."""
    cmd = [sys.executable, "-m", "strata.cli", "serve", *args, "--port", "0"]
    env = {**os.environ, "STRATA_CACHE_DIR": str(cache_dir)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    timer = _Watchdog(proc, timeout_s)
    try:
        while line := proc.stdout.readline():
            lines.append(line)
            if m := _READY.search(line):
                return ServeProcess(proc, m.group(2), m.group(1))
    finally:
        timer.cancel()
    proc.wait()
    raise AssertionError("strata serve did not start:\n" + "".join(lines[-40:]))


class _Watchdog:
    """Kills the process if it is not ready in time, so a stuck start never hangs the suite."""

    def __init__(self, proc: subprocess.Popen[str], timeout_s: float) -> None:
        import threading

        self._timer = threading.Timer(timeout_s, proc.kill)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()


def shared_model_cache() -> Path:
    """Where tests keep the default model: STRATA_TEST_MODEL_CACHE, else the user's cache (so the
    suite and `make serve` download it once between them)."""
    explicit = os.environ.get("STRATA_TEST_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "strata"
