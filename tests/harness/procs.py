"""Processes that tests and benchmarks start: output in a log file, ready on an observable sign,
stopped by PID.

    proc = spawn("gateway", [python, "-m", "strata.cli", "gateway", "--port", "0"], log_dir)
    url = proc.wait_for_output(r"Strata gateway on (\\S+)", timeout_s=30).group(1)
    proc.kill(); proc.start()      # a crash, then a restart with the same command line
    proc.stop()                    # SIGTERM to the process, then SIGKILL to its group

Each process runs in a session of its own, so that `stop` and `kill` reach whatever it started
and nothing else. Every wait is bounded and ends early, with the tail of the log, when the
process exits. A server that lost its port to another process (between the moment a free port
was found and its own bind) exits saying "address already in use": `lost_its_port` tells, and
the caller that chose the port starts it again on another one (`start_up` does for `strata up`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from strata.cluster.ports import free_port

ADDRESS_IN_USE = re.compile(r"address already in use|port \d+ on \S+ is in use", re.IGNORECASE)
_UP_READY = re.compile(r"instances? .*behind (http://127\.0\.0\.1:\d+)")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, *,
               interval_s: float = 0.05) -> float:
    """Poll `predicate` until it is true; returns the seconds that took. Raises TimeoutError
    after `timeout_s` (a correctness wait: it never hangs, and never judges speed)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - started


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Proc:
    """One command line, started (and restarted) by `start`; its output appended to `log`."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None  # None: this process's environment
    cwd: Path | None = None
    url: str = ""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_offset: int = 0  # where the output of the latest start begins in `log`

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    @property
    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> Proc:
        """Start the command line (again); returns self."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                          start_new_session=True)
        return self

    def output(self) -> str:
        """What the latest start has printed so far."""
        if not self.log.exists():
            return ""
        with self.log.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-num_lines:])

    @property
    def lost_its_port(self) -> bool:
        """Exited because another process holds the port it was told to listen on."""
        return not self.is_running and bool(ADDRESS_IN_USE.search(self.output()))

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
        """`wait_until`, failing at once (with the log's tail) if the process exits first."""
        def exited_or_ready() -> bool:
            return not self.is_running or predicate()

        try:
            took = wait_until(exited_or_ready, timeout_s, what)
        except TimeoutError as exc:
            raise TimeoutError(f"{self.name}: {exc}; its output ends:\n{self.tail()}") from None
        if not self.is_running and not predicate():  # it may have exited once ready
            code = self.popen.returncode if self.popen is not None else None
            raise RuntimeError(f"{self.name} exited with {code} before {what}; its output "
                               f"ends:\n{self.tail()}")
        return took

    def wait_for_output(self, pattern: str | re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first match of `pattern` in the latest start's output, once it is printed."""
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []

        def printed() -> bool:
            match = regex.search(self.output())
            if match is not None:
                found.append(match)
            return match is not None

        self.wait_until(printed, timeout_s, f"{regex.pattern!r} in its output")
        return found[-1]

    def stop(self, timeout_s: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        """`sig` to the process (a graceful stop), then SIGKILL to what is left of its group
        (itself after `timeout_s`, or what it started). Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            self._kill_group()
        return self.popen.wait(timeout=30)

    def kill(self) -> int | None:
        """SIGKILL to the process and its group (a crash); reaped. Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:  # never signal a group whose leader is long gone
            self._kill_group()
        return self.popen.wait(timeout=30)

    def _kill_group(self) -> None:
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass  # nothing is left of the group


def spawn(name: str, argv: Sequence[str], log_dir: Path, *, url: str = "",
          env: dict[str, str] | None = None, cwd: Path | None = None) -> Proc:
    """Start `argv` with its output in `log_dir/NAME.log`."""
    return Proc(name, list(argv), log_dir / f"{name}.log", env=env, cwd=cwd, url=url).start()


def stop_all(procs: Sequence[Proc]) -> None:
    """Stop every process, the last started first; a failure to stop one never skips another."""
    for proc in reversed(procs):
        try:
            proc.stop()
        except Exception as exc:  # keep stopping the others
            print(f"warning: stopping {proc.name}: {exc}", file=sys.stderr)


def start_up(args: Sequence[str], run_dir: Path, *, env: dict[str, str] | None = None,
             timeout_s: float = 300.0, python: str = sys.executable,
             cwd: Path | None = None, attempts: int = 3) -> Proc:
    """`strata up ARGS --port P` on a free port P, once it printed that it serves (`url` set).

    `env` must hold STRATA_RUN_DIR=`run_dir` when the caller wants it there. If another process
    took P before the gateway could bind it, `strata up` is stopped and started on another port.
    """
    for _ in range(attempts):
        argv = [python, "-m", "strata.cli", "up", "--port", str(free_port()), *args]
        proc = spawn("up", argv, run_dir.parent, env=env, cwd=cwd)
        if _serves_or_lost_its_port(proc, run_dir / "logs" / "gateway.log", timeout_s):
            return proc
        proc.stop(sig=signal.SIGINT, timeout_s=60)  # the port was taken: try another
    raise RuntimeError(f"strata up lost its port {attempts} times in a row")


def _serves_or_lost_its_port(up: Proc, gateway_log: Path, timeout_s: float) -> bool:
    """True once `strata up` serves (its `url` set); False if its gateway lost the port."""
    def gateway_lost_it() -> bool:
        text = gateway_log.read_text(errors="replace") if gateway_log.exists() else ""
        return bool(ADDRESS_IN_USE.search(text)) or bool(ADDRESS_IN_USE.search(up.output()))

    def settled() -> bool:
        return _UP_READY.search(up.output()) is not None or gateway_lost_it()

    try:
        up.wait_until(settled, timeout_s, "strata up to serve")
    except RuntimeError:
        if not up.lost_its_port:
            raise
    match = _UP_READY.search(up.output())
    if match is None:
        gateway_log.unlink(missing_ok=True)  # the next start's gateway writes a fresh one
        return False
    up.url = match.group(1)
    return True


__all__ = ["ADDRESS_IN_USE", "Proc", "http_ok", "spawn", "start_up", "stop_all", "wait_until"]
