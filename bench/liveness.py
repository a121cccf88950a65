"""How long a rank takes to learn that its gloo peer is gone (issue 28 item 2).

Two local processes join a T=2 gloo group (the path of ranks on two hosts) with the heartbeats
of strata/model/parallel/liveness.py. Rank 0 (this process) runs all-reduces in a loop; rank 1
is SIGSTOPped (a lost node: silent, nothing closed) or SIGKILLed (its connections close) mid-loop.
Reported: the time from the signal to rank 0's `RankFailedError` naming rank 1, per run, and
the median.

    PYTHONPATH=. .venv/bin/python bench/liveness.py --runs 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import time

import torch

from strata.errors import RankFailedError
from strata.model.parallel.comm import CommSpec, connect, free_port
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shm import new_segment_prefix

CTX = mp.get_context("spawn")


def _spec() -> CommSpec:
    return CommSpec(ParallelLayout(tensor_size=2), new_segment_prefix(), world_backend="gloo",
                    tp_backend="gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                    timeout_s=60, liveness_port=free_port("127.0.0.1"))


def _peer(spec: CommSpec) -> None:
    comms = connect(spec, 1)
    x = torch.ones(64)
    try:
        while True:
            comms.tp.all_reduce(x)
    except RankFailedError:
        os._exit(3)


def one_run(how: signal.Signals) -> float:
    """Seconds from `how` sent to rank 1 until rank 0's all-reduce raised, naming rank 1."""
    spec = _spec()
    proc = CTX.Process(target=_peer, args=(spec,), daemon=True)
    proc.start()
    comms = connect(spec, 0)
    x = torch.ones(64)
    try:
        for _ in range(200):
            comms.tp.all_reduce(x)
        assert proc.pid is not None
        os.kill(proc.pid, how)
        start = time.monotonic()
        try:
            while True:
                comms.tp.all_reduce(x)
        except RankFailedError as exc:
            elapsed = time.monotonic() - start
            assert exc.rank == 1, exc
        return elapsed
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        comms.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for how in (signal.SIGSTOP, signal.SIGKILL):
        times = [one_run(how) for _ in range(args.runs)]
        print(f"{how.name}: median {statistics.median(times) * 1e3:.0f} ms, runs "
              + ", ".join(f"{t * 1e3:.0f}" for t in times) + " ms", flush=True)


if __name__ == "__main__":
    main()
