"""How the ranks other than 0 come to exist: the `RankLauncher` protocol and its mp version.

A launcher first places the ranks (says on which host each will run: the executor picks the
collectives from that), then starts ranks 1 .. W-1 from their `RankSpec`s, waits until each
reports ready (or fails, with the rank's own traceback), watches them for an unexpected exit,
and stops them.
`MpRankLauncher` spawns local processes (multiprocessing "spawn": no forked torch state). A Ray
launcher (Ray actors in one placement group) implements the same protocol in strata/cluster/,
since the model layer never imports Ray; its ranks run `worker.run_rank` the same way.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Protocol

from strata.errors import ModelLoadError, RankFailedError
from strata.model.parallel.comm import Host
from strata.model.parallel.commands import RankReport, RankSpec
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.worker import mp_worker_main

log = logging.getLogger("strata.model.parallel")
OnExit = Callable[[RankFailedError], None]
LOCAL_HOST = Host("local", "127.0.0.1")


class RankLauncher(Protocol):
    """Starts, watches and stops the ranks of one instance other than rank 0.

    Contract: `place` is called once, first: it reserves room for all W ranks and returns the
    host of each (rank 0 is this process; ranks on one host share memory); `start` returns at
    once; `wait_ready` blocks until every started rank reported
    ready and returns their reports in rank order, or raises (ModelLoadError with the rank's
    traceback when it failed to start, RankFailedError when it exited or the time ran out);
    after `watch(on_exit)`, an unexpected exit of a rank calls `on_exit` once, from another
    thread; `stop` waits up to `timeout_s` for the ranks to exit, then kills them.
    """

    def place(self, layout: ParallelLayout) -> list[Host]: ...

    def start(self, specs: list[RankSpec]) -> None: ...

    def wait_ready(self, timeout_s: float) -> list[RankReport]: ...

    def watch(self, on_exit: OnExit) -> None: ...

    def pids(self) -> dict[int, int]: ...

    def stop(self, timeout_s: float) -> None: ...


class MpRankLauncher:
    """Ranks as local processes, spawned from the calling thread (it must live as long as the
    ranks: a rank gets SIGKILL when the thread that spawned it exits).

    `hosts` (tests and benchmarks) gives each rank a host as if they ran on several: every one
    is this machine, but a group whose ranks have different host ids talks through gloo, as it
    would across machines. Rank 0's address must be this machine's (e.g. 127.0.0.1).
    """

    def __init__(self, hosts: list[Host] | None = None) -> None:
        self._ctx = mp.get_context("spawn")
        self._hosts = hosts
        self._procs: dict[int, BaseProcess] = {}
        self._conns: dict[int, Connection] = {}
        self._stopping = threading.Event()

    def place(self, layout: ParallelLayout) -> list[Host]:
        return self._hosts or [LOCAL_HOST] * layout.world_size

    def start(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            ours, theirs = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=mp_worker_main, args=(spec, theirs),
                                     name=f"strata-rank-{spec.rank}", daemon=True)
            proc.start()
            theirs.close()
            self._procs[spec.rank], self._conns[spec.rank] = proc, ours

    def wait_ready(self, timeout_s: float) -> list[RankReport]:
        deadline = time.monotonic() + timeout_s
        reports: dict[int, RankReport] = {}
        pending = dict(self._conns)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailedError(f"ranks {sorted(pending)} were not ready within "
                                      f"{timeout_s:g} s", rank=min(pending))
            for ready in wait(list(pending.values()), timeout=left):
                rank = next(r for r, c in pending.items() if c is ready)
                reports[rank] = self._receive_report(rank, pending.pop(rank))
        return [reports[r] for r in sorted(reports)]

    def _receive_report(self, rank: int, conn: Connection) -> RankReport:
        try:
            kind, body = conn.recv()
        except EOFError:
            proc = self._procs[rank]
            proc.join(5)
            raise RankFailedError(f"rank {rank} exited with code {proc.exitcode} while starting",
                                  rank=rank) from None
        if kind == "error":
            raise ModelLoadError(f"rank {rank} failed to start:\n{body}")
        assert isinstance(body, RankReport)
        return body

    def watch(self, on_exit: OnExit) -> None:
        thread = threading.Thread(target=self._watch, args=(on_exit,), daemon=True,
                                  name="strata-rank-watch")
        thread.start()

    def _watch(self, on_exit: OnExit) -> None:
        by_sentinel = {proc.sentinel: rank for rank, proc in self._procs.items()}
        if not by_sentinel:
            return
        (sentinel, *_) = wait(list(by_sentinel))
        if self._stopping.is_set():
            return
        assert isinstance(sentinel, int)
        rank = by_sentinel[sentinel]
        proc = self._procs[rank]
        proc.join(1)  # reaped at once, so that peers' liveness checks see it gone
        on_exit(RankFailedError(f"rank {rank} (pid {proc.pid}) exited with code "
                                f"{proc.exitcode}", rank=rank))

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items() if proc.pid is not None}

    def stop(self, timeout_s: float) -> None:
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for rank, proc in self._procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive() and proc.pid is not None:
                log.warning("rank %d did not stop in time: killing pid %d", rank, proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        for conn in self._conns.values():
            conn.close()
