"""The in-process KV block store: an LRU over bytes with a TTL (one process; tests, bench)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from strata.clock import Clock
from strata.state.kv_store.base import KVItem, KVStoreLimits, KVStoreOptions
from strata.types import BlockHash


class MemoryKVStore:
    """A KVStore in an OrderedDict: reads and writes refresh recency; the least recently used
    entries go first once `limits.max_bytes` would be exceeded."""

    def __init__(self, limits: KVStoreLimits, *,
                 clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._entries: OrderedDict[BlockHash, tuple[bytes, float | None]] = OrderedDict()
        self.num_bytes = 0

    async def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out = []
        for block_hash in hashes:
            payload = self._live(block_hash)
            if payload is None:
                break
            out.append(payload)
        return out

    async def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        return len(await self.get_prefix(hashes))

    async def put_many(self, items: Sequence[KVItem]) -> int:
        admitted = self.limits.admitted(items)
        ttl_s = self.limits.ttl_s
        expires_at = None if ttl_s is None else self.clock() + ttl_s
        for block_hash, payload in admitted:
            self._drop(block_hash)
            self._entries[block_hash] = (payload, expires_at)
            self.num_bytes += len(payload)
        while self.num_bytes > self.limits.max_bytes:
            self._drop(next(iter(self._entries)))
        return len(admitted)

    async def close(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _live(self, block_hash: BlockHash) -> bytes | None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        payload, expires_at = entry
        if expires_at is not None and self.clock() >= expires_at:
            self._drop(block_hash)
            return None
        self._entries.move_to_end(block_hash)
        return payload

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.num_bytes -= len(entry[0])


def from_url(url: str, options: KVStoreOptions) -> MemoryKVStore:
    return MemoryKVStore(options.limits, clock=options.clock)


__all__ = ["MemoryKVStore", "from_url"]
