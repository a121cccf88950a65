"""The in-process pin store: one gateway (tests, or sessions that need not outlive it)."""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.state.pins.base import PinStoreOptions


class MemoryPinStore:
    """A PinStore in this process (single-threaded asyncio: no awaits inside an operation)."""

    def __init__(self, *, ttl_s: float = 3600.0, clock: Clock = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: dict[str, tuple[str, float]] = {}  # session -> (instance, expires_at)

    def _live(self, session_id: str) -> str | None:
        pin = self._pins.get(session_id)
        if pin is None or pin[1] <= self.clock():
            self._pins.pop(session_id, None)
            return None
        return pin[0]

    async def get(self, session_id: str) -> str | None:
        instance_id = self._live(session_id)
        if instance_id is not None:
            self._pins[session_id] = (instance_id, self.clock() + self.ttl_s)
        return instance_id

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        if self._live(session_id) != expected:
            return False
        self._pins[session_id] = (instance_id, self.clock() + self.ttl_s)
        return True

    async def delete(self, session_id: str) -> None:
        self._pins.pop(session_id, None)

    async def counts(self) -> dict[str, int]:
        now = self.clock()
        result: dict[str, int] = {}
        for instance_id, expires_at in self._pins.values():
            if expires_at > now:
                result[instance_id] = result.get(instance_id, 0) + 1
        return result

    async def close(self) -> None:
        return None


def from_url(url: str, options: PinStoreOptions) -> MemoryPinStore:
    return MemoryPinStore(ttl_s=options.ttl_s, clock=options.clock)


__all__ = ["MemoryPinStore", "from_url"]
