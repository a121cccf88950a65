"""KV by reference between instances on one host: a block pool in shared memory.

The HTTP pull (pd/prefill.py, pd/decode.py) moves a 1,024-token prompt's KV at about 1 GB/s over
loopback: every byte is framed, sent, received and parsed in Python. When P and D share a host,
the bytes need not travel at all:

    P  one anonymous shared-memory file (memfd "strata-kv"), reserved whole at P's first pull
       by reference (`posix_fallocate`: a full tmpfs refuses it then, never with a SIGBUS
       mid-copy) and mapped: a header page (magic, a random token, slot size and count), then
       slots of one KV payload each, keyed by chain hash (a block that several held prompts
       share takes one slot, counted). P names it in its layout (`shm`: path and token, not
       compared): /proc/P/fd/N, which only a process that shares P's /proc and user can open.
    D  `GET {P}/internal/kv/{handle}/shm?start&count` (pd/shm_pull.py): P's engine thread
       writes the blocks into their slots a batch at a time (one copy, summed as it goes),
       and P answers where, a line of JSON a batch (the token, then per block its chain
       hash, offset and length), so D reads a batch while the next is written. D maps the
       file once per P process, only when its header holds that token, and reads each block
       as it would from the stream: copied out of the pool into a reused buffer (`Staging`:
       what it checks is what the engine imports), the chain hash against its own, the crc32
       of the bytes summed in the copy's pass; the first bad block and every block after it
       are recomputed. A D on another host or in another container cannot open the path or
       finds another token: it pulls the stream, as it does when P's pool is full (409) or
       disabled (`--pd-shm-mb 0`).

A lease's slots are freed when the lease is released (acknowledged or expired), as its blocks
are: the pool never holds a block its lease let go. A lease can end while a D still reads (it
expires counted from its grant), so each slot begins with a stamp: the chain hash of the block
in it, written after the fill and zeroed when the slot is freed; D reads the stamp after its
copy, and a slot refilled meanwhile shows another hash (or none): that block is recomputed.
The memory goes back to the host when P exits and the last D that mapped it drops the mapping
(no file is left behind by a killed P).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from strata.errors import KVPoolFullError
from strata.types import BlockHash

log = logging.getLogger("strata.server.pd")

MAGIC = b"STKVPOOL"
STAMP = 64  # a slot's head: the chain hash of the block in it (zeros while free), then its payload
_HEADER = struct.Struct("<8s32sQQ")  # magic, token (hex), slot bytes, number of slots
PAGE = 4096
_POOL_PATH = re.compile(r"/proc/[0-9]+/fd/[0-9]+")


@dataclass(slots=True)
class Slot:
    index: int
    length: int  # of the payload in it; 0 until filled
    num_refs: int = 0


@dataclass(slots=True)
class ShmPool:
    """P's pool (see the module docstring). Created empty; `reserve` sizes it at first use."""

    capacity_bytes: int
    max_slots: int = 1 << 30  # no more than the blocks P's KV cache has
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    fd: int = -1
    view: mmap.mmap | None = None
    slot_bytes: int = 0
    num_slots: int = 0
    _free: list[int] = field(default_factory=list)
    _by_hash: dict[BlockHash, Slot] = field(default_factory=dict)
    _by_lease: dict[str, list[BlockHash]] = field(default_factory=dict)
    is_broken: bool = False  # the reservation failed: every pull takes the stream

    @classmethod
    def create(cls, capacity_bytes: int, max_slots: int = 1 << 30) -> ShmPool | None:
        """The pool, or None where shared memory cannot be had (no memfd: not Linux)."""
        if capacity_bytes <= 0 or not hasattr(os, "memfd_create"):
            return None
        try:
            fd = os.memfd_create("strata-kv", os.MFD_CLOEXEC)
        except OSError as exc:
            log.warning("no shared-memory KV pool (hand-offs use the HTTP stream): %s", exc)
            return None
        return cls(capacity_bytes, max_slots, fd=fd)

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def describe(self) -> dict[str, Any]:
        """What the layout handshake shows of the pool."""
        return {"path": self.path, "token": self.token}

    def reserve(self, payload_bytes: int) -> bool:
        """Size the pool for payloads of `payload_bytes` (once); False when it cannot be."""
        if self.view is not None:
            return payload_bytes <= self.slot_bytes
        if self.is_broken:
            return False
        slot = -(-(payload_bytes + STAMP) // PAGE) * PAGE
        num_slots = min((self.capacity_bytes - PAGE) // slot, self.max_slots)
        if num_slots < 1:
            self.is_broken = True
            return False
        size = PAGE + num_slots * slot
        try:
            os.posix_fallocate(self.fd, 0, size)
            self.view = mmap.mmap(self.fd, size)
        except OSError as exc:
            log.warning("the shared-memory KV pool could not reserve %d MiB (hand-offs use the "
                        "HTTP stream): %s", size >> 20, exc)
            self.is_broken = True
            return False
        self.slot_bytes, self.num_slots = slot, num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        _HEADER.pack_into(self.view, 0, MAGIC, self.token.encode(), slot, num_slots)
        log.info("shared-memory KV pool: %d slots of %d KiB (%d MiB)", num_slots, slot >> 10,
                 size >> 20)
        return True

    def offset(self, index: int) -> int:
        """Where slot `index`'s payload starts (its stamp is the STAMP bytes before)."""
        return PAGE + index * self.slot_bytes + STAMP

    def filled(self, slot: Slot, length: int, block_hash: BlockHash) -> None:
        """Marks a slot written through `view_of` as holding `length` bytes of `block_hash`'s
        payload, and stamps it so: a D that copied it checks the stamp after the copy, so a
        slot freed and refilled meanwhile (its lease ended early) is never taken for the block
        it held."""
        assert self.view is not None, "invariant pool_reserved"
        slot.length = length
        start = self.offset(slot.index) - STAMP
        self.view[start: start + len(block_hash)] = block_hash

    def take(self, lease: str, hashes: list[BlockHash], payload_bytes: int) -> list[Slot]:
        """Slots for the blocks `hashes` names, held by `lease`, in order: a block already in
        the pool shares its slot (filled: `length` > 0), the others get free ones to fill
        (`view_of`, then `filled`). All or nothing: raises KVPoolFullError (nothing taken) when
        they do not fit."""
        if not hashes or not self.reserve(payload_bytes):
            raise KVPoolFullError("the shared-memory pool is not available")
        new = {h for h in hashes if h not in self._by_hash}
        if len(new) > len(self._free):
            raise KVPoolFullError(f"the shared-memory pool has {len(self._free)} free slots, "
                                f"{len(new)} wanted")
        taken = self._by_lease.setdefault(lease, [])
        slots = []
        for block_hash in hashes:
            slot = self._by_hash.get(block_hash)
            if slot is None:
                slot = self._by_hash[block_hash] = Slot(self._free.pop(), 0)
            slot.num_refs += 1
            taken.append(block_hash)
            slots.append(slot)
        return slots

    def view_of(self, slot: Slot) -> memoryview:
        """The slot's bytes, writable."""
        assert self.view is not None, "invariant pool_reserved"
        start = self.offset(slot.index)
        return memoryview(self.view)[start: start + self.slot_bytes - STAMP]

    def put(self, lease: str, items: list[tuple[BlockHash, bytes]]) -> list[tuple[int, int]]:
        """`take` and fill with payloads at hand: (offset, length) of each, in order."""
        slots = self.take(lease, [h for h, _ in items], max((len(p) for _, p in items),
                                                             default=0))
        for slot, (block_hash, payload) in zip(slots, items, strict=True):
            if not slot.length:
                with self.view_of(slot) as out:
                    out[: len(payload)] = payload
                self.filled(slot, len(payload), block_hash)
        return [(self.offset(slot.index), slot.length) for slot in slots]

    def release(self, lease: str) -> None:
        """The lease ended: its slots are free once no other lease holds their blocks."""
        for block_hash in self._by_lease.pop(lease, []):
            slot = self._by_hash[block_hash]
            slot.num_refs -= 1
            if slot.num_refs == 0:
                del self._by_hash[block_hash]
                if self.view is not None:  # unstamped before anything else is written there
                    start = self.offset(slot.index) - STAMP
                    self.view[start: start + STAMP] = bytes(STAMP)
                self._free.append(slot.index)

    @property
    def num_used(self) -> int:
        return len(self._by_hash)

    def close(self) -> None:
        self._by_hash.clear()
        self._by_lease.clear()
        if self.view is not None:
            with contextlib.suppress(BufferError):
                self.view.close()
            self.view = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmPeers:
    """D's mappings of the pools of P instances on its host, by token (at most `max_pools`,
    the least recently used dropped first)."""

    def __init__(self, max_pools: int = 8) -> None:
        self.max_pools = max_pools
        self._pools: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._paths: dict[str, str] = {}  # token -> the path it was mapped from
        self._refused: set[str] = set()  # tokens this process cannot map (another host)

    def may_reach(self, described: object) -> bool:
        """Whether the pool `described` may be this host's: its path opens here (a P elsewhere
        is then not asked to fill its pool for nothing) and its token was not refused."""
        path, token = _path_and_token(described)
        if path is None or token is None or token in self._refused:
            return False
        return token in self._pools or os.access(path, os.R_OK)

    @staticmethod
    def token_of(described: object) -> str | None:
        return _path_and_token(described)[1]

    def attach(self, described: object) -> mmap.mmap | None:
        """The mapping of the pool a layout `described` ({path, token}), or None where this
        process cannot open it or the file there is not that pool."""
        path, token = _path_and_token(described)
        if path is None or token is None or token in self._refused:
            return None
        pool = self._pools.get(token)
        if pool is not None:
            self._pools.move_to_end(token)
            return pool
        pool = _map_pool(path, token)
        if pool is None:
            self._refused.add(token)
            return None
        self._pools[token] = pool
        self._paths[token] = path
        while len(self._pools) > self.max_pools:
            self.forget(next(iter(self._pools)))
        return pool

    def prune(self) -> int:
        """Drop the mappings of pools whose P is gone (its /proc path no longer there): a dead
        P's memory goes back to the host once no D maps it. How many were dropped."""
        gone = [token for token, path in self._paths.items() if not os.path.exists(path)]
        for token in gone:
            self.forget(token)
        return len(gone)

    def forget(self, token: str) -> None:
        self._paths.pop(token, None)
        pool = self._pools.pop(token, None)
        if pool is not None:
            with contextlib.suppress(BufferError):
                pool.close()

    def close(self) -> None:
        for token in list(self._pools):
            self.forget(token)


class Staging:
    """D's copies of blocks read from pools, reused: a block is copied out of P's pool (what D
    checks is then what its engine imports, whatever P does with the slot), into a buffer
    whose pages were touched by an earlier pull, not fresh ones (the kernel's page faults on
    fresh memory cost as much as the copy). Buffers come back once the engine imported them
    (`give_back`), up to `max_bytes` kept."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[bytearray]] = {}
        self.num_free_bytes = 0

    def get(self, num_bytes: int) -> bytearray:
        free = self._free.get(num_bytes)
        if free:
            self.num_free_bytes -= num_bytes
            return free.pop()
        return bytearray(num_bytes)

    def give_back(self, buffers: list[bytearray]) -> None:
        for buffer in buffers:
            if self.num_free_bytes + len(buffer) > self.max_bytes:
                return
            self._free.setdefault(len(buffer), []).append(buffer)
            self.num_free_bytes += len(buffer)


def _path_and_token(described: object) -> tuple[str | None, str | None]:
    """The pool's path and token as a layout describes them; a path that is not another
    process's descriptor (/proc/PID/fd/N) is none: D opens nothing else a peer names."""
    if not isinstance(described, dict):
        return None, None
    path, token = described.get("path"), described.get("token")
    return (path if isinstance(path, str) and _POOL_PATH.fullmatch(path) else None,
            token if isinstance(token, str) else None)


def _map_pool(path: str, token: str) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        log.info("the shared-memory KV pool at %s is not reachable from here (the HTTP stream "
                 "it is): %s", path, exc)
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size < PAGE:
            return None
        size = status.st_size
        pool = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        log.info("the shared-memory KV pool at %s cannot be mapped: %s", path, exc)
        return None
    finally:
        os.close(fd)
    magic, found, _, _ = _HEADER.unpack_from(pool, 0)
    if magic != MAGIC or found.decode(errors="replace") != token:
        pool.close()
        return None
    return pool


__all__ = ["PAGE", "STAMP", "ShmPeers", "ShmPool", "Slot", "Staging"]
