"""`strata serve` processes forked from one warm process, for tests that start several real
instances (test_pd_faults_e2e.py: each doomed instance SIGKILLs itself at its fault point;
tests/model_stack.py: the fuzzers' generating and embedding instances).

The zygote (this file run as a script) imports torch and the serving stack once, starts no
thread, then forks one child per request: the child is a process of its own (its own session,
its output in its own log, the environment given), which runs `strata.cli.main(["serve", ...])`
exactly as `python -m strata.cli serve ...` would, and exits as it would (a kill point's SIGKILL
included). Each fork saves the ~2.5 s of CPU a new interpreter spends importing torch.

    with Zygote() as zygote:
        served = zygote.serve(ARGS, cache_dir=..., log=...)   # once it printed its ready line
        (or zygote.start(...), then served.wait_ready(timeout_s): several start side by side)
        served.url; served.wait(timeout_s) -> exit code (-9: SIGKILL); served.stop()

The zygote reports on its stdout `started PID` and `exited PID CODE` lines; at EOF on its stdin
(the test is done, or died) it SIGKILLs what is left of its children and exits.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

_READY = re.compile(r"Strata serving (\S+) on (http://127\.0\.0\.1:\d+) \(ready in")


def _report(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _run_child(job: dict[str, Any]) -> None:
    """In the forked child: become `strata serve ARGV` (never returns)."""
    code = 1
    try:
        os.setsid()
        out = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = [sys.argv[0], *job["argv"]]
        from strata.cli import main

        code = main(job["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def zygote_main() -> None:
    import torch  # noqa: F401  (what a fork saves importing)
    import uvicorn  # noqa: F401

    import strata.cli  # noqa: F401
    import strata.commands.serve  # noqa: F401
    import strata.commands.serve_stack  # noqa: F401
    import strata.model.executor  # noqa: F401
    import strata.model.loader  # noqa: F401
    import strata.server.app  # noqa: F401

    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _run_child(json.loads(line))
                children.add(pid)
                _report(f"started {pid}")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _report(f"exited {pid} {os.waitstatus_to_exitcode(status)}")
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        os.waitpid(pid, 0)


@dataclass
class ForkedServe:
    zygote: Zygote
    pid: int
    log: Path
    url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until it printed its ready line (`url` set); RuntimeError (it stopped) if it exits
        first or takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (ready := _READY.search(self.output())) is None:
            if self.zygote.exited(self.pid) is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"forked strata serve (pid {self.pid}) did not get ready "
                                   f"(exit code {self.zygote.exited(self.pid)}); its output "
                                   f"ends:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        self.url = ready.group(2)

    def wait(self, timeout_s: float) -> int:
        """Its exit code once it exited (-9: SIGKILLed); TimeoutError if it did not."""
        return self.zygote.exit_code(self.pid, timeout_s)

    def stop(self) -> None:
        """SIGKILL to its session (a crash), and wait until the zygote reaped it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.wait(30)


class Zygote:
    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, start_new_session=True)
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            kind, pid, *code = line.decode().split()
            with self._changed:
                if kind == "started":
                    self._started.append(int(pid))
                else:
                    self._exits[int(pid)] = int(code[0])
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _wait(self, found: Any, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (value := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.popen.poll() is not None:
                    raise TimeoutError(f"zygote: no {what} within {timeout_s:g} s "
                                       f"(zygote exit code {self.popen.poll()})")
                self._changed.wait(min(left, 0.5))
            return value

    def exit_code(self, pid: int, timeout_s: float) -> int:
        code: int = self._wait(lambda: self._exits.get(pid), timeout_s, f"exit of {pid}")
        return code

    def start(self, args: list[str], *, cache_dir: Path, log: Path,
              timeout_s: float = 60) -> ForkedServe:
        """Fork `strata serve ARGS --port 0` (STRATA_CACHE_DIR=`cache_dir`, output in `log`);
        returns at once (`ForkedServe.wait_ready`)."""
        env = {**os.environ, "STRATA_CACHE_DIR": str(cache_dir)}
        job = {"argv": ["serve", *args, "--port", "0"], "env": env, "log": str(log)}
        assert self.popen.stdin is not None
        with self._changed:
            self.popen.stdin.write(json.dumps(job).encode() + b"\n")
            self.popen.stdin.flush()
            pid: int = self._wait(lambda: self._started.pop(0) if self._started else None,
                                  timeout_s, "fork")
        return ForkedServe(self, pid, log)

    def serve(self, args: list[str], *, cache_dir: Path, log: Path,
              timeout_s: float = 120) -> ForkedServe:
        """`start`, then `wait_ready`."""
        served = self.start(args, cache_dir=cache_dir, log=log)
        served.wait_ready(timeout_s)
        return served

    def exited(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def close(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.close()  # the zygote kills what is left and exits
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
        self._reader.join(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


if __name__ == "__main__":
    zygote_main()
