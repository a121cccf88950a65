"""`strata serve` as a real subprocess on a port it binds itself (`--port 0`), for end-to-end
tests: the process helper is tests/harness/procs.py."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.procs import Proc, spawn

_READY = r"Strata serving (\S+) on (http://127\.0\.0\.1:\d+) \(ready in"


@dataclass
class ServeProcess:
    process: Proc
    url: str
    served_name: str

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The running process (to signal it and wait for its exit code)."""
        assert self.process.popen is not None
        return self.process.popen

    def stop(self) -> None:
        """SIGKILL by PID (what a test needs from a server it is done with) and reap it."""
        self.process.kill()


def start_serve(args: list[str], *, cache_dir: Path, timeout_s: float = 600,
                env_extra: dict[str, str] | None = None, log_dir: Path | None = None,
                name: str = "serve") -> ServeProcess:
    """Start `strata serve ARGS --port 0`; returns once it printed its ready line.

    `timeout_s` bounds the wait (the first start may download the default model)."""
    argv = [sys.executable, "-m", "strata.cli", "serve", *args, "--port", "0"]
    env = {**os.environ, "STRATA_CACHE_DIR": str(cache_dir), **(env_extra or {})}
    logs = log_dir or Path(tempfile.mkdtemp(prefix="strata-serve-"))
    process = spawn(name, argv, logs, env=env)
    try:
        ready = process.wait_for_output(_READY, timeout_s)
    except BaseException:
        process.kill()
        raise
    process.url = ready.group(2)
    return ServeProcess(process, ready.group(2), ready.group(1))


def shared_model_cache() -> Path:
    """Where tests keep the default model: STRATA_TEST_MODEL_CACHE, else the user's cache (so the
    suite and `make serve` download it once between them)."""
    explicit = os.environ.get("STRATA_TEST_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "strata"
