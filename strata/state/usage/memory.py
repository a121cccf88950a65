"""The in-process usage store: one gateway (its counts and budgets are its own)."""

from __future__ import annotations

import time
from collections import defaultdict

from strata.clock import Clock
from strata.state.usage.base import WINDOW_S, Counts, UsageKey, UsageStoreOptions, Window, minute_of


class MemoryUsageStore:
    """A UsageStore in this process (single-threaded asyncio: no awaits inside an operation)."""

    def __init__(self, *, retention_s: float = 86400.0, clock: Clock = time.time) -> None:
        self.retention_s = retention_s
        self.clock = clock
        self._usage: dict[int, dict[UsageKey, Counts]] = defaultdict(dict)
        self._windows: dict[str, tuple[int, int, int]] = {}  # tenant -> minute, requests, tokens

    async def add(self, tenant: str, model: str, counts: Counts) -> None:
        minute = minute_of(self.clock())
        if minute not in self._usage:  # a new minute: forget those past the retention
            oldest = minute - int(self.retention_s // WINDOW_S)
            for old in [m for m in self._usage if m < oldest]:
                del self._usage[old]
        rows = self._usage[minute]
        rows[(tenant, model)] = rows.get((tenant, model), Counts()) + counts

    async def totals(self, since_s: float) -> dict[UsageKey, Counts]:
        first = minute_of(since_s)
        result: dict[UsageKey, Counts] = {}
        for minute, rows in self._usage.items():
            if minute >= first:
                for key, counts in rows.items():
                    result[key] = result.get(key, Counts()) + counts
        return result

    async def take(self, tenant: str, *, max_requests: int | None,
                   max_tokens: int | None) -> Window:
        now = self.clock()
        minute, num_requests, num_tokens = self._window(tenant, now)
        is_admitted = ((max_requests is None or num_requests < max_requests)
                       and (max_tokens is None or num_tokens < max_tokens))
        if is_admitted:
            num_requests += 1
            self._windows[tenant] = (minute, num_requests, num_tokens)
        return Window(is_admitted, num_requests, num_tokens, (minute + 1) * WINDOW_S - now)

    async def charge(self, tenant: str, num_tokens: int) -> None:
        minute, num_requests, tokens = self._window(tenant, self.clock())
        self._windows[tenant] = (minute, num_requests, tokens + num_tokens)

    async def close(self) -> None:
        return None

    def _window(self, tenant: str, now: float) -> tuple[int, int, int]:
        minute = minute_of(now)
        window = self._windows.get(tenant)
        return window if window is not None and window[0] == minute else (minute, 0, 0)


def from_url(url: str, options: UsageStoreOptions) -> MemoryUsageStore:
    return MemoryUsageStore(retention_s=options.retention_s, clock=options.clock)


__all__ = ["MemoryUsageStore", "from_url"]
