"""P's side of a pull by reference (pd/shm.py): the blocks go into P's shared-memory pool and
D is told where, in lines of JSON as each batch lands, so that D reads batch k while P's engine
thread writes batch k + 1:

    GET {P}/internal/kv/{handle}/shm?start=I&count=N      (the fleet's internal key)
    200 application/x-ndjson
        {"token": "<the pool's token>"}
        [["<chain hash hex>", offset, length], ...]      one line per batch, in block order
    409  the pool cannot take them now (full, or none): D pulls the stream
    404  the handle is unknown, acknowledged or expired

Every slot is taken before the first line (all or nothing: a pool too full answers 409, not a
half manifest). A stream that ends early (the engine died) is a truncated pull: D recomputes
what it did not get, as with the stream. The lease counts the pull until the response ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from strata.errors import EngineDeadError, KVPoolFullError
from strata.protocol.errors import error_json
from strata.server.pd.leases import Lease
from strata.server.pd.prefill import ClosingStream, LeasedPull, not_found, one_ahead, span_of
from strata.server.pd.shm import ShmPool, Slot
from strata.server.pd.state import PD, pd_of
from strata.types import BlockHash

BATCH = 16  # blocks written per visit of the engine thread (about 1.5 ms for SmolLM2's)


async def pull_shm(request: Request) -> Response:
    """GET /internal/kv/{handle}/shm?start=I&count=N (see the module docstring)."""
    pd = pd_of(request)
    if pd.shm is None:
        return _refused("this instance has no shared-memory KV pool")
    lease = pd.leases.begin_pull(request.path_params["handle"])
    if lease is None:
        return not_found()
    try:
        first, count = span_of(request, len(lease.held))
        block_ids = list(lease.held.block_ids[first: first + count])
        hashes = [BlockHash(h) for h in lease.held.block_hashes[first: first + count]]
        slots = await _take(pd, pd.shm, lease, block_ids, hashes)
    except BaseException as exc:  # whatever it is, this pull is over: the lease may end
        pd.leases.end_pull(lease, is_complete=True)
        if isinstance(exc, KVPoolFullError):
            return _refused(str(exc))
        if isinstance(exc, EngineDeadError):
            return not_found()
        raise
    fill = PoolFill(pd, pd.shm, lease, first, block_ids, hashes, slots)
    return ClosingStream(fill.lines(), fill.close, media_type="application/x-ndjson")


async def _take(pd: PD, pool: ShmPool, lease: Lease, block_ids: list[int],
                hashes: list[BlockHash]) -> list[Slot]:
    """The lease's slots for the blocks (KVPoolFullError when they do not fit); the first pull
    sizes the pool by the layout's payload size, or, from an executor that does not describe
    it, by one exported payload (EngineDeadError when the engine cannot read it)."""
    if pool.view is None and block_ids:
        size = pd.layout.get("payload_bytes")
        if not isinstance(size, int):
            sample = await pd.instance.engine.export_held(lease.request_id, block_ids[:1])
            if not sample:
                raise EngineDeadError("the held blocks can no longer be read")
            size = len(sample[0])
        pool.reserve(size)
    return pool.take(lease.handle, hashes, pool.slot_bytes)


class PoolFill(LeasedPull):
    """One pull by reference: the slots filled `BATCH` at a time by the engine thread
    (`AsyncEngine.export_held_into`), a line sent per batch."""

    def __init__(self, pd: PD, pool: ShmPool, lease: Lease, first: int, block_ids: list[int],
                 hashes: list[BlockHash], slots: list[Slot]) -> None:
        super().__init__(pd, lease, first)
        self.pool = pool
        self.block_ids, self.hashes, self.slots = block_ids, hashes, slots

    async def lines(self) -> AsyncIterator[bytes]:
        yield json.dumps({"token": self.pool.token}).encode() + b"\n"
        starts = range(0, len(self.slots), BATCH)
        async with contextlib.aclosing(one_ahead(starts, self._fill)) as batches:
            async for start, is_filled in batches:
                if not is_filled:
                    return  # the engine cannot read them: D sees a truncated pull
                yield json.dumps(self._shown(start)).encode() + b"\n"
                if start == 0:
                    self.pd.faults.reached("prefill_during_pull")
        self.is_complete = True

    async def _fill(self, start: int) -> bool:
        """Writes the batch's slots that no earlier pull filled; False when it cannot."""
        empty = [(i, slot) for i, slot in enumerate(self.slots[start: start + BATCH], start)
                 if not slot.length]
        if not empty:
            return True
        views = [self.pool.view_of(slot) for _, slot in empty]
        call = asyncio.ensure_future(self.pd.instance.engine.export_held_into(
            self.lease.request_id, [self.block_ids[i] for i, _ in empty], views))
        # the views live until the engine thread is done with them, even when this pull is
        # cancelled (D closed the stream) before it ran the call
        call.add_done_callback(lambda _: _release(views))
        try:
            lengths = await asyncio.shield(call)
        except EngineDeadError:
            lengths = []
        if len(lengths) != len(empty):
            return False
        for (i, slot), length in zip(empty, lengths, strict=True):
            self.pool.filled(slot, length, self.hashes[i])
        return True

    def _shown(self, start: int) -> list[list[object]]:
        """The batch's manifest line; a block the fault config damages is damaged in its slot
        first (tests)."""
        pool = self.pool.view
        assert pool is not None, "invariant pool_reserved"
        shown: list[list[object]] = []
        for i in range(start, min(start + BATCH, len(self.slots))):
            offset, length = self.pool.offset(self.slots[i].index), self.slots[i].length
            block_hash = self.hashes[i]
            if self.pd.faults.damages(self.first + i):
                block_hash, damaged = self.pd.faults.damage(self.first + i, block_hash,
                                                            pool[offset: offset + length])
                pool[offset: offset + length] = damaged
            self.pd.metrics.pull_bytes.labels("prefill").inc(length)
            shown.append([block_hash.hex(), offset, length])
        return shown


def _release(views: list[memoryview]) -> None:
    for view in views:
        view.release()


def _refused(why: str) -> Response:
    return Response(error_json(409, f"{why}; pull the stream"), 409,
                    media_type="application/json")


__all__ = ["BATCH", "PoolFill", "pull_shm"]
