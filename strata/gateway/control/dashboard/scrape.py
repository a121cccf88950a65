"""The instances' own counters, read for the dashboard: output tokens, inter-token latency and the
prefix-cache hit rate are measured where tokens are made (the gateway relays stream bytes and
never counts tokens in them).

`CounterReader.read` GETs every live instance's `/metrics` (Prometheus text, no API key needed),
at most once per `min_interval_s` however many dashboards poll, and only when one does: a gateway
nobody watches reads nothing. The difference between two reads of an instance is what it did in
between; a counter that went down means the instance restarted, and its new value is the
difference. Tokens/s and the mean inter-token latency of the fleet go to the `LiveSeries`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from strata.clock import Clock
from strata.gateway.control.dashboard.series import LiveSeries
from strata.gateway.routing.instances import DEAD, InstanceView

OUTPUT_TOKENS = "strata:generation_tokens_total"
ITL_SUM = "strata:time_per_output_token_seconds_sum"  # per request: its mean inter-token time
ITL_COUNT = "strata:time_per_output_token_seconds_count"
PREFIX_HIT_RATE = "strata:prefix_cache_hit_rate"
_WANTED = (OUTPUT_TOKENS, ITL_SUM, ITL_COUNT, PREFIX_HIT_RATE)


@dataclass(frozen=True, slots=True)
class InstanceCounters:
    """What one read of an instance's /metrics gave (each summed over its label sets)."""

    output_tokens: float = 0.0
    itl_sum_s: float = 0.0
    num_itl: float = 0.0
    prefix_hit_rate: float | None = None

    def since(self, before: InstanceCounters) -> InstanceCounters:
        """The counters' growth since `before` (a counter that went down restarted from 0)."""
        def grew(now: float, then: float) -> float:
            return now - then if now >= then else now

        return InstanceCounters(grew(self.output_tokens, before.output_tokens),
                                grew(self.itl_sum_s, before.itl_sum_s),
                                grew(self.num_itl, before.num_itl), self.prefix_hit_rate)


def parse_counters(text: str) -> InstanceCounters:
    """The wanted samples of a Prometheus text exposition; a line scan, not a full parser."""
    sums = dict.fromkeys(_WANTED, 0.0)
    seen: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("strata:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen.add(name)
    hit_rate = sums[PREFIX_HIT_RATE] if PREFIX_HIT_RATE in seen else None
    return InstanceCounters(sums[OUTPUT_TOKENS], sums[ITL_SUM], sums[ITL_COUNT], hit_rate)


class CounterReader:
    """Reads the instances' counters into the series; keeps each instance's last read."""

    def __init__(self, client: httpx.AsyncClient, series: LiveSeries, *, timeout_s: float = 0.5,
                 min_interval_s: float = 1.0, clock: Clock = time.time) -> None:
        self.client = client
        self.series = series
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.last: dict[str, InstanceCounters] = {}
        self._read_at = -float("inf")

    def prefix_hit_rate(self, instance_id: str) -> float | None:
        last = self.last.get(instance_id)
        return last.prefix_hit_rate if last is not None else None

    async def read(self, views: Sequence[InstanceView]) -> None:
        """Read every live instance, unless the last read is younger than `min_interval_s`."""
        now = self.clock()
        if now - self._read_at < self.min_interval_s:
            return
        started_at, self._read_at = self._read_at, now  # claimed before the first await
        live = [v for v in views if v.model and v.state != DEAD]
        reads = await asyncio.gather(*(self._read_one(v) for v in live))
        grown = InstanceCounters()
        fresh: dict[str, InstanceCounters] = {}
        for view, counters in zip(live, reads, strict=True):
            if counters is None:
                continue
            fresh[view.instance_id] = counters
            before = self.last.get(view.instance_id)
            if before is not None:
                grown = _add(grown, counters.since(before))
        self.last = fresh
        itl_s = grown.itl_sum_s / grown.num_itl if grown.num_itl else None
        self.series.record_decode(started_at, now, grown.output_tokens, itl_s)

    async def _read_one(self, view: InstanceView) -> InstanceCounters | None:
        try:
            response = await self.client.get(f"{view.url}/metrics", timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        return parse_counters(response.text) if response.status_code == 200 else None


def _add(a: InstanceCounters, b: InstanceCounters) -> InstanceCounters:
    return InstanceCounters(a.output_tokens + b.output_tokens, a.itl_sum_s + b.itl_sum_s,
                            a.num_itl + b.num_itl)


__all__ = ["CounterReader", "InstanceCounters", "parse_counters"]
