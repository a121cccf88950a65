"""The scheduler's priority order: who runs first, who may preempt whom, and the waiting queue.

`Request.priority` has the API's polarity (higher = more important; `strata.types.PriorityClass`
names the classes). This module is the one place that turns it into the scheduler's order:

    rank(request)   its priority; INTERACTIVE for a request aged below it
    order           rank descending, then arrival ascending (first come, first served)

Aging: a request that is not sheddable and ranks below INTERACTIVE becomes aged once its time
spent waiting (in the queue, before its first admission and after each preemption; never while
it runs) reaches `max_queue_wait_s`; it then ranks with the top class for good. So its wait is
bounded: only requests of the top class that arrived before it, or above the top class, go first.

A waiting request may preempt a running one only when its rank is strictly higher. Equal ranks
never preempt each other, so they cannot ping-pong; a rank changes only once (aging), upwards,
so two requests swap places at most once.

The waiting queue keeps one FIFO (a heap by arrival) per priority value and one for aged
requests: a preempted request goes back under its original arrival time and keeps its place.
A heap of aging deadlines moves requests to the aged FIFO when their deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence

from strata.engine.request import Request, RequestStatus
from strata.types import PriorityClass

TOP = int(PriorityClass.INTERACTIVE)
_AGED = object()  # the key of the aged requests' FIFO


def rank(request: Request) -> int:
    return max(request.priority, TOP) if request.is_aged else request.priority


def order_key(request: Request) -> tuple[int, float]:
    """Sort key: the first request in the scheduler's order has the smallest key."""
    return (-rank(request), request.arrival_time)


def below(requests: Iterable[Request], than: Request) -> list[Request]:
    """The `requests` ranked strictly below `than`, lowest first (the latest arrival first
    within a rank): the ones `than` may preempt, in the order it would."""
    floor = rank(than)
    return sorted((r for r in requests if rank(r) < floor), key=order_key, reverse=True)


def victims(request: Request, running: Iterable[Request], *, needs_slot: bool,
            num_blocks_short: int, num_freeable: Callable[[Request], int]) -> list[Request] | None:
    """The running requests to preempt, lowest first, so that `request` gets a running slot
    (when it `needs_slot`) and `num_blocks_short` more free blocks: [] when it lacks nothing,
    None when even every request ranked below it would not make room."""
    if not needs_slot and num_blocks_short <= 0:
        return []
    chosen: list[Request] = []
    num_freed = 0
    for lower in below(running, request):
        if chosen and num_freed >= num_blocks_short:
            break
        chosen.append(lower)
        num_freed += num_freeable(lower)
    return chosen if chosen and num_freed >= num_blocks_short else None


def to_defer(request: Request, scheduled: Sequence[tuple[Request, int]], *,
             num_tokens_short: int, num_seats_short: int, may_split: bool) -> dict[Request, int]:
    """Tokens to take back from this step's entries ranked below `request`, lowest first:
    `num_seats_short` whole entries (the batch has no seat for `request`), then tokens until
    they cover `num_tokens_short`; {request: tokens}. With `may_split` (chunked prefill) an
    entry gives only what is missing. Those requests keep their blocks and compute later."""
    taken: dict[Request, int] = {}
    for lower in below((r for r, _ in scheduled), request):
        if num_seats_short <= 0 and num_tokens_short <= 0:
            break
        num_tokens = sum(n for r, n in scheduled if r is lower)
        if num_seats_short <= 0 and may_split:
            num_tokens = min(num_tokens, num_tokens_short)
        num_seats_short -= 1
        taken[lower] = num_tokens
        num_tokens_short -= num_tokens
    return taken


class WaitingQueue:
    """Waiting (and preempted) requests, FIFO by arrival within each priority value and among
    aged requests. Entries of requests that finished while waiting stay until they reach a
    head; the scheduler skips them. `max_queue_wait_s` None turns aging off."""

    def __init__(self, max_queue_wait_s: float | None) -> None:
        self.max_queue_wait_s = max_queue_wait_s
        self._fifos: dict[object, list[tuple[float, int, Request]]] = {}  # never left empty
        self._deadlines: list[tuple[float, int, float, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request, now: float) -> None:
        """`request` starts (or after a preemption, resumes) waiting at `now`."""
        request.queued_at = now
        count = next(self._counter)
        key = _AGED if request.is_aged else request.priority
        heapq.heappush(self._fifos.setdefault(key, []), (request.arrival_time, count, request))
        if self._may_age(request):
            assert self.max_queue_wait_s is not None
            deadline = now + self.max_queue_wait_s - request.waited_s
            heapq.heappush(self._deadlines, (deadline, count, now, request))

    def peek(self, now: float) -> Request | None:
        """The first waiting request in the scheduler's order at `now`."""
        self._age(now)
        heads = [self._head(key) for key in list(self._fifos)]
        best = min((e for e in heads if e is not None), default=None,
                   key=lambda e: (*order_key(e[2]), e[1]))
        return None if best is None else best[2]

    def pop(self, request: Request, now: float) -> None:
        """Remove `request`, which `peek` just returned: it leaves the queue at `now`."""
        key = _AGED if request.is_aged else request.priority
        fifo = self._fifos[key]
        if fifo[0][2] is not request:
            raise RuntimeError(f"waiting_pop_is_a_head: {request.request_id} is not first")
        heapq.heappop(fifo)
        if not fifo:
            del self._fifos[key]
        request.waited_s += now - (request.queued_at if request.queued_at is not None
                                   else request.arrival_time)

    def _may_age(self, request: Request) -> bool:
        return (self.max_queue_wait_s is not None and not request.is_aged
                and PriorityClass.of(request.priority) is not PriorityClass.SHEDDABLE
                and request.priority < TOP)

    def _age(self, now: float) -> None:
        """Move every request whose wait reached the bound to the aged FIFO."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, count, queued_at, request = heapq.heappop(self._deadlines)
            if request.is_aged or request.status not in _WAITING \
                    or request.queued_at != queued_at:
                continue  # finished, or admitted since (a later wait has its own deadline)
            request.is_aged = True  # its entry in its priority's FIFO is now stale
            heapq.heappush(self._fifos.setdefault(_AGED, []),
                           (request.arrival_time, count, request))

    def _head(self, key: object) -> tuple[float, int, Request] | None:
        """The first live entry of one FIFO (stale entries of aged requests dropped)."""
        fifo = self._fifos[key]
        while fifo and key is not _AGED and fifo[0][2].is_aged:
            heapq.heappop(fifo)
        if not fifo:
            del self._fifos[key]
            return None
        return fifo[0]


_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

__all__ = ["TOP", "WaitingQueue", "below", "order_key", "rank", "to_defer", "victims"]
