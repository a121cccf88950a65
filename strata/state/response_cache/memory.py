"""The in-process response cache: one gateway, LRU by total bytes and entries."""

from __future__ import annotations

import time
from collections import OrderedDict

from strata.state.response_cache.base import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_TTL_S,
    Clock,
    EntryLimits,
    ResponseCacheOptions,
)


class MemoryResponseCache(EntryLimits):
    """A ResponseCache in this process: LRU by total bytes and entries (single-threaded asyncio:
    no awaits inside an operation)."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                 max_entries: int = DEFAULT_MAX_ENTRIES, clock: Clock = time.time) -> None:
        super().__init__(ttl_s=ttl_s, max_entry_bytes=max_entry_bytes)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.clock = clock
        self.num_bytes = 0  # invariant: the sum of len(value) over _entries
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        ttl = self.admit(value, ttl_s)
        if ttl is None:
            return False
        self._remove(key)
        self._entries[key] = (bytes(value), self.clock() + ttl)
        self.num_bytes += len(value)
        while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))
        return True

    async def close(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= len(entry[0])


def from_url(url: str, options: ResponseCacheOptions) -> MemoryResponseCache:
    return MemoryResponseCache(ttl_s=options.ttl_s, max_bytes=options.max_bytes,
                               max_entry_bytes=options.max_entry_bytes,
                               max_entries=options.max_entries, clock=options.clock)


__all__ = ["MemoryResponseCache", "from_url"]
