"""Per-second samples for the dashboard's charts: the last few minutes of traffic.

A ring of `num_slots` one-second slots, indexed by `int(t) % num_slots`; a slot whose second is
stale is reset on its first write of a new second, so nothing ever sweeps the ring. Two feeders,
neither of them per streamed chunk:

    observe          a proxy observer (`Proxy.observers`), called once per attempt at its first
                     byte or its failure: one answer (or failed attempt) and its time to first
                     byte go into the current second's slot; O(1), no lock (one event loop)
    record_decode    the instances' own counters (dashboard_scrape.py), read about once a second
                     while a dashboard is open: output tokens/s and the mean inter-token latency
                     over the read interval, written to every second that interval covers

Time to first byte is what the gateway measures: from sending the request upstream to the first
SSE frame of a stream, or to the whole body of an answer that is not streamed.

`observe` also keeps the `num_slowest` slowest first bytes of the window, each with its request
id and, when tracing is on and the request sampled, its trace id (`slowest`): the way from a slow
request on the dashboard to its trace. Only an answer slower than the slowest kept looks its ids
up, so the cost per attempt is a comparison or two.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from strata.clock import Clock
from strata.gateway.routing.instances import InstanceView
from strata.protocol.request_id import current_request_id
from strata.tracing import current_trace_id

# a decode interval longer than this (no dashboard was open) only sets a new baseline
MAX_DECODE_INTERVAL_S = 10.0


@dataclass(slots=True)
class Slot:
    """One second. Counters are summed as events arrive; the decode fields are rates."""

    second: int = -1
    num_answers: int = 0
    num_failures: int = 0
    ttft_sum_s: float = 0.0
    ttft_max_s: float = 0.0
    output_tokens_per_s: float | None = None
    itl_s: float | None = None

    def reset(self, second: int) -> None:
        self.second = second
        self.num_answers = self.num_failures = 0
        self.ttft_sum_s = self.ttft_max_s = 0.0
        self.output_tokens_per_s = self.itl_s = None


@dataclass(frozen=True, slots=True)
class SlowRequest:
    """One of the slowest first bytes of the window."""

    at_s: float  # wall clock
    ttft_s: float
    instance_id: str
    request_id: str | None
    trace_id: str | None  # None: tracing off, or the request not sampled

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at_s, "ttft_ms": _ms(self.ttft_s), "instance_id": self.instance_id,
                "request_id": self.request_id, "trace_id": self.trace_id}


class LiveSeries:
    """The ring of slots; `window` turns the last seconds into chart columns."""

    def __init__(self, num_slots: int = 300, clock: Clock = time.time,
                 num_slowest: int = 10) -> None:
        self.num_slots = num_slots
        self.clock = clock
        self.num_slowest = num_slowest
        self.started_s = int(clock())  # no second before this one is shown
        self._slots = [Slot() for _ in range(num_slots)]
        self._slowest: list[SlowRequest] = []  # slowest first, at most num_slowest
        self._oldest_s = 0.0  # the earliest `at_s` among them

    def _slot(self, second: int) -> Slot:
        slot = self._slots[second % self.num_slots]
        if slot.second != second:
            slot.reset(second)
        return slot

    def observe(self, view: InstanceView, is_error: bool, ttft_s: float | None) -> None:
        """One attempt's outcome (the proxy observer's signature)."""
        now = self.clock()
        slot = self._slot(int(now))
        if is_error:
            slot.num_failures += 1
            return
        slot.num_answers += 1
        if ttft_s is not None:
            slot.ttft_sum_s += ttft_s
            slot.ttft_max_s = max(slot.ttft_max_s, ttft_s)
            self._keep_if_slow(view, ttft_s, now)

    def _keep_if_slow(self, view: InstanceView, ttft_s: float, now: float) -> None:
        kept = self._slowest
        if len(kept) >= self.num_slowest and ttft_s <= kept[-1].ttft_s:
            if self._oldest_s > now - self.num_slots:  # every one kept is slower, and recent
                return
            kept[:] = [s for s in kept if s.at_s > now - self.num_slots]
            self._oldest_s = min((s.at_s for s in kept), default=now)
            if len(kept) >= self.num_slowest and ttft_s <= kept[-1].ttft_s:
                return
        kept.append(SlowRequest(now, ttft_s, view.instance_id, current_request_id(),
                                current_trace_id()))
        kept.sort(key=lambda s: -s.ttft_s)
        del kept[self.num_slowest:]
        self._oldest_s = min(s.at_s for s in kept)

    def slowest(self) -> list[SlowRequest]:
        """The slowest first bytes of the last `num_slots` seconds, slowest first."""
        since = self.clock() - self.num_slots
        return [s for s in self._slowest if s.at_s > since]

    def record_decode(self, start_s: float, end_s: float, num_tokens: float,
                      itl_s: float | None) -> None:
        """`num_tokens` generated between two reads at `start_s` and `end_s` (wall clock), at a
        mean inter-token latency of `itl_s` (None: no request finished in between)."""
        interval_s = end_s - start_s
        if not 0.0 < interval_s <= MAX_DECODE_INTERVAL_S:
            return
        rate = num_tokens / interval_s
        for second in range(int(start_s) + 1, int(end_s) + 1):
            slot = self._slot(second)
            slot.output_tokens_per_s, slot.itl_s = rate, itl_s

    def window(self, num_s: int) -> dict[str, list[Any]]:
        """Columns over the last `num_s` complete seconds since the series started (the
        current one is still filling); a mean nothing was measured for is None (a gap)."""
        last = int(self.clock()) - 1
        first = max(last - min(num_s, self.num_slots - 1) + 1, self.started_s)
        seconds = range(first, last + 1)
        slots = [self._slots[s % self.num_slots] for s in seconds]
        rows = [slot if slot.second == s else Slot(s) for s, slot in zip(seconds, slots,
                                                                        strict=True)]
        return {
            "t": list(seconds),
            "answers_per_s": [r.num_answers for r in rows],
            "failures_per_s": [r.num_failures for r in rows],
            "ttft_ms_mean": [_ms(r.ttft_sum_s / r.num_answers) if r.num_answers else None
                             for r in rows],
            "ttft_ms_max": [_ms(r.ttft_max_s) if r.num_answers else None for r in rows],
            "itl_ms_mean": [_ms(r.itl_s) if r.itl_s is not None else None for r in rows],
            "output_tokens_per_s": [_round(r.output_tokens_per_s) for r in rows],
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 3)


__all__ = ["MAX_DECODE_INTERVAL_S", "LiveSeries", "Slot", "SlowRequest"]
