"""Shared-memory collectives between real processes: exact sums, identical on every rank,
chunked messages, timeouts, and a SIGKILLed peer detected in well under 2 s."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from model.parallel import shm_workers as workers

from strata.errors import RankFailedError
from strata.model.parallel.shm import SHM_DIR, ShmGroup, new_segment_prefix, sweep_stale_segments

pytestmark = pytest.mark.needs("shm")
CTX = mp.get_context("spawn")


@contextmanager
def segment(world: int, **options: Any) -> Iterator[str]:
    name = new_segment_prefix() + "-test"
    ShmGroup.create(name, world, **options)
    try:
        yield name
    finally:
        ShmGroup.unlink(name)


class Pool:
    """Warm rank processes, spawned children of this process with torch imported once: each
    runs one rank function at a time (shm_workers.serve_jobs) and comes back here when it ended
    cleanly; one that was killed, hung or failed is killed and never used again."""

    def __init__(self) -> None:
        self.idle: list[tuple[mp.process.BaseProcess, Connection]] = []

    def spawn(self) -> tuple[mp.process.BaseProcess, Connection]:
        ours, theirs = CTX.Pipe()
        proc = CTX.Process(target=workers.serve_jobs, args=(theirs,))
        proc.start()
        theirs.close()
        return proc, ours

    def take(self) -> tuple[mp.process.BaseProcess, Connection]:
        return self.idle.pop(0) if self.idle else self.spawn()

    def give_back(self, proc: mp.process.BaseProcess, conn: Connection, clean: bool) -> None:
        if clean and proc.is_alive() and conn.poll(10):
            try:
                if conn.recv() == workers.JOB_DONE:
                    self.idle.append((proc, conn))
                    return
            except EOFError:
                pass
        stop(proc)

    def close(self) -> None:
        for proc, conn in self.idle:
            conn.close()  # serve_jobs ends at EOF
            proc.join(10)
            stop(proc)
        self.idle.clear()


def stop(proc: mp.process.BaseProcess) -> None:
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    running = Pool()
    running.idle = [running.spawn() for _ in range(3)]  # the most any test runs at once
    yield running
    running.close()


@contextmanager
def ranks(pool: Pool, target: Callable[..., None], name: str, world: int, members: list[int],
          *extra: Any) -> Iterator[list[tuple[mp.process.BaseProcess, Connection]]]:
    """Run `target(name, rank, world, *extra, conn)` for each rank in `members`, each in a
    process of its own from `pool`."""
    started: list[tuple[mp.process.BaseProcess, Connection]] = []
    clean = False
    try:
        for rank in members:
            proc, conn = pool.take()
            started.append((proc, conn))
            conn.send((target.__name__, (name, rank, world, *extra)))
        yield started
        clean = True
    finally:
        for proc, conn in started:
            pool.give_back(proc, conn, clean)


def fixed_order_sum(world: int, n: int, dtype: str) -> torch.Tensor:
    parts = [workers.rank_input(r, n, dtype).float() for r in range(world)]
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total.to(workers.DTYPES[dtype])


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_agree_bit_for_bit_on_every_rank(pool: Pool, world: int) -> None:
    n = 32 * 576  # a decode step's batch of hidden states; chunked by the 4 KiB buffer
    with segment(world, buffer_bytes=4096, p2p=True) as name, \
            ranks(pool, workers.collectives, name, world, list(range(world)), n) as procs:
        results = [conn.recv() for _, conn in procs]
    for dtype in workers.DTYPES:
        sums = [workers.unpack(r[0][dtype]) for r in results]
        check_sums(sums, world, n, dtype)
    for rank, (_, gathered, at_root, got, empty, ring, ring_tensor) in enumerate(results):
        gathered, at_root = workers.unpack(gathered), workers.unpack(at_root)
        widths = [3 + r for r in range(world)]
        columns = [torch.arange(2 * w, dtype=torch.float32).view(2, -1) + 100 * r
                   for r, w in enumerate(widths)]
        assert torch.equal(gathered, torch.cat(columns, dim=1))
        assert (at_root is not None) == (rank == 1)
        assert got and empty == b""
        src = (rank - 1) % world
        assert ring == f"from {src}".encode() * 1000
        assert torch.equal(workers.unpack(ring_tensor), torch.full((3, 5), float(src)))


def check_sums(sums: list[torch.Tensor | None], world: int, n: int, dtype: str) -> None:
    """Every rank's sum is the rank-order float32 sum rounded once, byte for byte."""
    expected = fixed_order_sum(world, n, dtype)
    raw = expected.view(torch.uint8).numpy().tobytes()
    for summed in sums:
        assert summed is not None and summed.dtype == expected.dtype
        assert summed.view(torch.uint8).numpy().tobytes() == raw
    stacked = torch.stack([workers.rank_input(r, n, dtype).float() for r in range(world)])
    torch.testing.assert_close(expected.float(), stacked.sum(0).to(expected.dtype).float())


def test_broadcasts_and_messages_run_depth_ahead_of_their_reader(pool: Pool) -> None:
    """Pipeline parallel: rank 0 broadcasts the next batches while the last stage still works.
    With depth 3, three broadcasts and three messages go out before rank 1 reads any."""
    with segment(2, p2p=True, depth=3) as name, \
            ranks(pool, workers.read_when_told, name, 2, [1], 6) as procs:
        conn = procs[0][1]
        group = ShmGroup.attach(name, 0, 2, timeout_s=30)
        assert conn.recv() == "attached"
        for i in range(3):
            group.broadcast_bytes(f"step {i}".encode(), timeout_s=5)
            group.send_bytes(f"hidden {i}".encode(), 1, timeout_s=5)
        conn.send("read now")
        for i in range(3, 6):
            group.broadcast_bytes(f"step {i}".encode())
            group.send_bytes(f"hidden {i}".encode(), 1)
        assert conn.recv() == [(f"step {i}".encode(), f"hidden {i}".encode())
                               for i in range(6)]
        group.close()


def test_a_root_waits_once_depth_broadcasts_are_unread(pool: Pool) -> None:
    with segment(2, depth=2) as name, \
            ranks(pool, workers.read_when_told_or_released, name, 2, [1], 3) as procs:
        group = ShmGroup.attach(name, 0, 2, timeout_s=30)
        assert procs[0][1].recv() == "attached"
        group.broadcast_bytes(b"one", timeout_s=5)
        group.broadcast_bytes(b"two", timeout_s=5)
        with pytest.raises(RankFailedError, match=r"rank 1 .* did not reach the collective"):
            group.broadcast_bytes(b"three", timeout_s=0.3)
        group.close()
        procs[0][1].send(workers.RELEASE)  # it read nothing; back to the pool


def test_a_peer_that_never_arrives_times_out_naming_it(pool: Pool) -> None:
    with segment(2) as name, ranks(pool, workers.reduce_then_wait, name, 2, [1]) as procs:
        group = ShmGroup.attach(name, 0, 2, timeout_s=30)
        group.all_reduce(torch.ones(8))
        assert procs[0][1].recv() == "reduced"
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 .* did not reach the collective "
                                                  r"within 0.3 s") as failure:
            group.all_reduce(torch.ones(8), timeout_s=0.3)
        assert 0.3 <= time.monotonic() - start < 2
        assert failure.value.rank == 1
        with pytest.raises(RankFailedError, match="reported failed"):  # the group stays failed
            group.barrier()
        group.close()
        procs[0][1].send(workers.RELEASE)  # alive all along; back to the pool


def test_a_sigkilled_peer_is_detected_by_every_rank_within_2_s(pool: Pool) -> None:
    """Rank 2 dies while rank 0 (this process) and rank 1 wait for it in an all_reduce; it is
    a zombie child of this process until the end, which kill(pid, 0) alone would miss."""
    with segment(3) as name, ranks(pool, workers.reduce_then_report, name, 3, [1]) as reporter, \
            ranks(pool, workers.reduce_then_hang, name, 3, [2]) as victim:
        group = ShmGroup.attach(name, 0, 3, timeout_s=30)
        group.all_reduce(torch.ones(8))
        assert reporter[0][1].recv() == "reduced" and victim[0][1].recv() == "reduced"
        failures: list[tuple[RankFailedError, float]] = []

        def second_reduce() -> None:
            try:
                group.all_reduce(torch.ones(8))
            except RankFailedError as exc:
                failures.append((exc, time.monotonic()))

        waiter = threading.Thread(target=second_reduce)
        waiter.start()
        victim_pid = victim[0][0].pid
        assert victim_pid is not None
        killed_at = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        waiter.join(10)
        message, blamed, seen_at = reporter[0][1].recv()
        assert failures, "rank 0 never saw the death"
        exc, raised_at = failures[0]
        assert exc.rank == 2 and "rank 2" in str(exc)
        assert raised_at - killed_at < 2.0
        assert blamed == 2 and seen_at - killed_at < 2.0, message
        group.close()


def test_an_idle_worker_leaves_its_wait_when_rank_0_dies(pool: Pool) -> None:
    with segment(2) as name, ranks(pool, workers.attach_and_hang, name, 2, [0]) as root, \
            ranks(pool, workers.idle_wait_for_broadcast, name, 2, [1]) as idle:
        assert root[0][1].recv() == "attached" and idle[0][1].recv() == "attached"
        root_pid = root[0][0].pid
        assert root_pid is not None
        killed_at = time.monotonic()
        os.kill(root_pid, signal.SIGKILL)
        assert idle[0][1].poll(5), "the idle worker is still waiting"
        message, blamed, seen_at = idle[0][1].recv()
        assert blamed == 0 and "died" in message
        assert seen_at - killed_at < 2.0


def test_segments_of_dead_creators_are_swept_and_live_ones_kept() -> None:
    child = CTX.Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    stale = SHM_DIR / f"strata-{child.pid}-0badc0de-world"
    stale.write_bytes(b"")
    with segment(2) as live:
        removed = sweep_stale_segments()
        assert stale.name in removed and not stale.exists()
        assert (SHM_DIR / live).exists()
