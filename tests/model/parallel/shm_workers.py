"""Rank processes for the shared-memory collective tests (spawned: importable by name)."""

from __future__ import annotations

import math
import threading
import time
from multiprocessing.connection import Connection

import torch

from strata.errors import RankFailedError
from strata.model.parallel.comm import CommSpec, connect
from strata.model.parallel.shm import ShmGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_input(rank: int, n: int, dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=gen) * 10).to(DTYPES[dtype])


def pack(t: torch.Tensor | None) -> tuple[str, tuple[int, ...], bytes] | None:
    """A tensor as plain data for a pipe (torch's own pickling shares storage by fd)."""
    if t is None:
        return None
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), raw


def unpack(packed: tuple[str, tuple[int, ...], bytes] | None) -> torch.Tensor | None:
    if packed is None:
        return None
    dtype, shape, raw = packed
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(DTYPES[dtype]).view(shape) if raw else torch.empty(shape, dtype=DTYPES[dtype])


def collectives(name: str, rank: int, world: int, n: int, conn: Connection) -> None:
    """all_reduce (float32, bfloat16), gather (uneven widths, to all and to root 1), broadcast
    and a p2p ring; sends back every result."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    group.wait_attached(30)
    sums = {d: pack(group.all_reduce(rank_input(rank, n, d).clone())) for d in DTYPES}
    widths = [3 + r for r in range(world)]
    part = torch.arange(2 * widths[rank], dtype=torch.float32).view(2, -1) + 100 * rank
    gathered = group.gather(part, widths)
    at_root = group.gather(part, widths, root=1)
    payload = bytes(range(256)) * 100  # 25.6 KB: chunked when the buffer is small
    got = group.broadcast_bytes(payload if rank == 0 else None)
    empty = group.broadcast_bytes(b"" if rank == 1 else None, root=1)
    dst, src = (rank + 1) % world, (rank - 1) % world
    group.send_bytes(f"from {rank}".encode() * 1000, dst)
    ring = group.recv_bytes(src)
    group.send(torch.full((3, 5), float(rank)), dst)
    ring_tensor = group.recv(torch.empty(3, 5), src)
    group.barrier()
    conn.send((sums, pack(gathered), pack(at_root), got == payload, empty, ring,
               pack(ring_tensor)))
    group.close()


def reduce_then_hang(name: str, rank: int, world: int, conn: Connection) -> None:
    """One all_reduce with the others, then alive but never at the next collective."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    group.all_reduce(torch.ones(8))
    conn.send("reduced")
    threading.Event().wait()


def reduce_then_report(name: str, rank: int, world: int, conn: Connection) -> None:
    """One all_reduce, then a second one that must fail: sends back the error and when."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    group.all_reduce(torch.ones(8))
    conn.send("reduced")
    try:
        group.all_reduce(torch.ones(8))
    except RankFailedError as exc:
        conn.send((str(exc), exc.rank, time.monotonic()))
    group.close()


def attach_and_hang(name: str, rank: int, world: int, conn: Connection) -> None:
    ShmGroup.attach(name, rank, world)
    conn.send("attached")
    threading.Event().wait()


def idle_wait_for_broadcast(name: str, rank: int, world: int, conn: Connection) -> None:
    """An idle worker: waits for ever for rank 0's next broadcast; reports how it ended."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    conn.send("attached")
    try:
        group.broadcast_bytes(None, root=0, timeout_s=math.inf)
    except RankFailedError as exc:
        conn.send((str(exc), exc.rank, time.monotonic()))


def read_when_told(name: str, rank: int, world: int, count: int, conn: Connection) -> None:
    """Attach, then read nothing until told; then `count` (broadcast, message) pairs from
    rank 0, sent back in order."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    conn.send("attached")
    conn.recv()
    pairs = [(group.broadcast_bytes(None, root=0), group.recv_bytes(0)) for _ in range(count)]
    conn.send(pairs)
    group.close()


def through_connect(spec: CommSpec, rank: int, conn: Connection) -> None:
    """`connect` a rank of `spec` (T = 2, P = 1) and run each kind of call once on its groups."""
    comms = connect(spec, rank)
    summed = comms.tp.all_reduce(rank_input(rank, 576, "float32").clone())
    part = torch.full((2, 1 + rank), float(rank))
    gathered = comms.tp.gather(part, [1, 2], root=0)
    step = comms.world.broadcast_bytes(b"step" if rank == 0 else None, timeout_s=math.inf)
    if rank == 0:
        comms.world.send_bytes(b"tokens", 1)
        comms.world.send(torch.arange(4.0), 1)
        received: object = None
    else:
        received = (comms.world.recv_bytes(0), pack(comms.world.recv(torch.empty(4), 0)))
    comms.world.barrier()
    conn.send((pack(summed), pack(gathered), step, received))
    comms.close()


# --- a pool of warm rank processes (test_shm.py): torch imported once per process, not per test

JOB_DONE = "job done"
RELEASE = "release"


def serve_jobs(conn: Connection) -> None:
    """A spawned process that runs this module's rank functions one after another: each job is
    (function name, args), run as `function(*args, conn)`, then JOB_DONE. Ends at EOF."""
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            return
        globals()[name](*args, conn)
        conn.send(JOB_DONE)


def reduce_then_wait(name: str, rank: int, world: int, conn: Connection) -> None:
    """As `reduce_then_hang`: one all_reduce, then alive but never at the next collective, until
    RELEASE comes (the process goes back to its pool)."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    group.all_reduce(torch.ones(8))
    conn.send("reduced")
    assert conn.recv() == RELEASE
    group.close()


def read_when_told_or_released(name: str, rank: int, world: int, count: int,
                               conn: Connection) -> None:
    """As `read_when_told`, but RELEASE instead of the word to read ends it reading nothing."""
    group = ShmGroup.attach(name, rank, world, timeout_s=30)
    conn.send("attached")
    if conn.recv() == RELEASE:
        group.close()
        return
    pairs = [(group.broadcast_bytes(None, root=0), group.recv_bytes(0)) for _ in range(count)]
    conn.send(pairs)
    group.close()
