"""Warm rank processes for the parity tests (test_parity.py, test_default_model_parallel.py):
the ranks of one instance after another run in the same few processes, so that each imports
torch and strata once per module, not once per layout.

A `WarmRankPool` process is spawned (multiprocessing "spawn", as `MpRankLauncher` does: a
child of this process, from this thread, no forked torch state) before any instance exists;
`WarmLauncher` (a `RankLauncher`) hands it a `RankSpec`, and it runs the rank exactly as
`mp_worker_main` does (`die_with_parent`, `run_rank`: connect, load the shard, report ready,
serve commands). A rank that ends with Stop (exit code 0) goes back to the pool for the next
instance; any other end exits the process with the rank's code, as a spawned rank would, so
the executor's watch sees the exit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from strata.errors import RankFailedError
from strata.model.parallel.commands import RankSpec
from strata.model.parallel.launcher import MpRankLauncher, OnExit
from strata.model.parallel.worker import die_with_parent, run_rank

CTX = mp.get_context("spawn")
STOPPED = ("stopped", 0)
WATCH_THREAD = "strata-warm-rank-watch"


def warm_rank(control: Connection) -> None:
    """A pool process: run the rank of each RankSpec received, one at a time; ends at EOF."""
    while True:
        try:
            spec = control.recv()
        except EOFError:
            return
        assert isinstance(spec, RankSpec)
        die_with_parent(spec.parent_pid)
        logging.basicConfig(level=logging.INFO, force=True,
                            format=f"rank {spec.rank} %(levelname)s: %(message)s")
        code = run_rank(spec, lambda kind, body: control.send((kind, body)))
        if code != 0:
            control.close()
            os._exit(code)
        control.send(STOPPED)


class WarmRankPool:
    """Idle warm rank processes; `launcher()` makes a launcher that takes its ranks from here."""

    def __init__(self, size: int) -> None:
        self.idle = [self._spawn() for _ in range(size)]  # importing side by side

    @staticmethod
    def _spawn() -> tuple[BaseProcess, Connection]:
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=warm_rank, args=(theirs,), name="strata-warm-rank",
                           daemon=True)
        proc.start()
        theirs.close()
        return proc, ours

    def take(self) -> tuple[BaseProcess, Connection]:
        return self.idle.pop(0) if self.idle else self._spawn()

    def give_back(self, proc: BaseProcess, conn: Connection) -> None:
        self.idle.append((proc, conn))

    def launcher(self) -> WarmLauncher:
        return WarmLauncher(self)

    def close(self) -> None:
        watching = [t.name for t in threading.enumerate() if t.name == WATCH_THREAD]
        assert not watching, f"{len(watching)} launcher watches outlived their executors"
        for _, conn in self.idle:
            conn.close()  # warm_rank ends at EOF
        for proc, _ in self.idle:
            kill(proc, wait_s=10)
        self.idle.clear()


def kill(proc: BaseProcess, wait_s: float) -> None:
    proc.join(wait_s)
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


class WarmLauncher(MpRankLauncher):
    """`MpRankLauncher` whose ranks come from a `WarmRankPool` (placement and readiness are
    MpRankLauncher's own) and go back to it when stopped.

    The watch for an unexpected exit ends at `stop`, not when the rank processes exit (they
    live on in the pool): a watch thread left waiting would hold the executor (its `on_exit`)
    until the pool closes, and drop rank 0's weights from a daemon thread while the
    interpreter exits (an abort: "terminate called without an active exception")."""

    def __init__(self, pool: WarmRankPool) -> None:
        super().__init__()
        self._pool = pool
        self._wake_reader, self._wake_writer = CTX.Pipe(duplex=False)
        self._watcher: threading.Thread | None = None

    def watch(self, on_exit: OnExit) -> None:
        self._watcher = threading.Thread(target=self._watch_until_stopped, args=(on_exit,),
                                         daemon=True, name=WATCH_THREAD)
        self._watcher.start()

    def _watch_until_stopped(self, on_exit: OnExit) -> None:
        by_sentinel = {proc.sentinel: rank for rank, proc in self._procs.items()}
        ready = wait([*by_sentinel, self._wake_reader])
        if self._stopping.is_set():
            return
        rank = next(by_sentinel[s] for s in ready if s in by_sentinel)  # type: ignore[index]
        proc = self._procs[rank]
        proc.join(1)
        on_exit(RankFailedError(f"rank {rank} (pid {proc.pid}) exited with code "
                                f"{proc.exitcode}", rank=rank))

    def start(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            proc, conn = self._pool.take()
            conn.send(spec)
            self._procs[spec.rank], self._conns[spec.rank] = proc, conn

    def stop(self, timeout_s: float) -> None:
        """Each rank back to the pool once it stopped (Stop); one that did not within
        `timeout_s` is killed."""
        self._stopping.set()
        if not self._wake_writer.closed:  # the first stop (an executor may stop twice)
            self._wake_writer.send(None)
            if self._watcher is not None:
                self._watcher.join(5)
            self._wake_writer.close()
            self._wake_reader.close()
        deadline = time.monotonic() + timeout_s
        for rank, proc in self._procs.items():
            conn = self._conns[rank]
            try:
                stopped = (conn.poll(max(0.0, deadline - time.monotonic()))
                           and conn.recv() == STOPPED)
            except (EOFError, OSError):
                stopped = False
            if stopped and proc.is_alive():
                self._pool.give_back(proc, conn)
            else:
                conn.close()
                kill(proc, wait_s=0)
        self._procs.clear()
        self._conns.clear()


__all__ = ["WarmLauncher", "WarmRankPool"]
