"""The main loop of a rank other than 0: join the groups, load the shard, run commands.

    connect -> load shard -> report ready -> loop: wait for the next command (no timeout:
    an idle instance sends none), run it -> Stop: exit 0

A worker never outlives the serving process: it asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG; a launcher that is not its parent, e.g. Ray, relies on the next point),
and every wait checks rank 0's pid, so a worker whose rank 0 vanished leaves within ~50 ms with
`RankFailedError` and exits non-zero. A failure to start is reported to the launcher with its
traceback (`report`), never swallowed.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable

import torch

from strata.errors import RankFailedError
from strata.model import kernel_build
from strata.model.determinism import set_deterministic
from strata.model.parallel.comm import connect
from strata.model.parallel.commands import RankReport, RankSpec, Stop, decode
from strata.model.parallel.rank import Rank

log = logging.getLogger("strata.model.parallel")
_PR_SET_PDEATHSIG = 1
EXIT_RANK_FAILED = 3

Reporter = Callable[[str, "RankReport | str"], None]


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # not Linux: the liveness checks of every wait still apply
        pass
    if os.getppid() != parent_pid:
        os._exit(EXIT_RANK_FAILED)


def run_rank(spec: RankSpec, report: Reporter) -> int:
    """Start rank `spec.rank` and serve commands until Stop; returns the exit code."""
    try:
        rank = start_rank(spec)
    except Exception:
        report("error", traceback.format_exc())
        return 1
    report("ready", rank.report())
    return serve_rank(rank)


def start_rank(spec: RankSpec) -> Rank:
    """Join the groups and load the shard (a launcher that reports on its own, e.g. Ray's
    actors, calls this and `serve_rank` apart)."""
    torch.set_num_threads(spec.threads)
    kernel_build.use_cache_dir(spec.kernel_cache_dir)
    set_deterministic(spec.deterministic)
    comms = connect(spec.comm, spec.rank)
    try:
        return Rank(spec, comms)
    except BaseException:
        comms.close()
        raise


def serve_rank(rank: Rank) -> int:
    """Run commands until Stop (0) or a failed collective (EXIT_RANK_FAILED)."""
    try:
        with torch.inference_mode():
            serve(rank)
    except RankFailedError as exc:
        log.error("rank %d stops: %s", rank.spec.rank, exc)
        return EXIT_RANK_FAILED
    finally:
        rank.comms.close()
    return 0


def serve(rank: Rank) -> None:
    while True:
        command = decode(rank.comms.world.broadcast_bytes(None, root=0, timeout_s=math.inf))
        if isinstance(command, Stop):
            return
        rank.run(command)


def mp_worker_main(spec: RankSpec, conn: object) -> None:
    """Entry point of a rank spawned by `MpRankLauncher` (`conn`: its end of a Pipe)."""
    from multiprocessing.connection import Connection

    assert isinstance(conn, Connection)
    die_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"rank {spec.rank} %(levelname)s: %(message)s")

    def report(kind: str, body: RankReport | str) -> None:
        conn.send((kind, body))

    code = run_rank(spec, report)
    conn.close()
    sys.exit(code)
