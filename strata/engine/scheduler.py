"""Continuous batching: decides how many tokens of which requests run in the next step.

The scheduler speaks in token counts, not phases: a decode is 1 token, a prefill chunk is up to the
remaining budget, a prefix hit simply starts a request with `num_computed_tokens > 0`.
Running requests are served first (in priority order); when blocks run out the lowest-priority,
latest-arriving running request is preempted (its blocks freed, recomputed later). Waiting
requests are admitted by (priority, arrival) while budget, sequence slots and blocks last.
A request admitted with fetched KV blocks (see kv_cache_manager) lists them in `kv_imports`:
the engine has the executor import them before the step's forward pass and reports how many it
wrote (`on_kv_imported`); the scheduler turns a refused payload into a miss.

While decodes run, prefill tokens (new prompts, chunks of running ones) are capped by the
adaptive prefill budget (step_budget.py), which the engine feeds with each step's wall time.

Batches in flight (pipeline parallel): the engine reports each batch it submits and collects
(`on_submitted`, `on_collected`). A request's next batch starts after its tokens in flight, so a
prompt may be computed in chunks that are in flight together, while a request whose batch in
flight samples its next token sits out until that batch is back. With several batches in flight
each takes an even share of the requests, so that decodes split across batches and stages
overlap. The results of a request aborted or preempted while in flight are dropped, the blocks
its batches write stay held until they are back, and a preempted one is re-admitted only then.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from strata.engine.block_pool import KVBlock
from strata.engine.config import SchedulerConfig
from strata.engine.kv_cache_manager import ComputedBlocks, KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.step_budget import StepBudget
from strata.types import RequestId


@dataclass(frozen=True, slots=True)
class KVImport:
    """Fetched KV to write into `block_ids` of `request` before the forward pass."""

    request: Request
    block_ids: list[int]
    payloads: list[bytes]


@dataclass(slots=True)
class SchedulerOutput:
    """Requests to run this step, in batch order, with their number of new tokens. Once
    submitted, the batch holds `held_blocks` (the blocks it writes) until collected."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_imports: list[KVImport] = field(default_factory=list)
    held_blocks: list[KVBlock] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, *, max_concurrent_batches: int = 1
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_concurrent_batches = max_concurrent_batches
        self.running: list[Request] = []
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0
        self.num_kv_import_failures = 0
        self.step_budget = StepBudget(config.prefill_stretch, floor=16)
        self._prefill_left: int | None = None  # this step's prefill tokens left; None: no cap

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._push_waiting(request)

    def get(self, request_id: RequestId) -> Request | None:
        return self._requests.get(request_id)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the scheduler with a final status and free its blocks."""
        request.status = status
        self._requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)  # waiting requests are skipped lazily when popped

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        max_seqs = self._max_seqs_per_batch()
        num_decodes = sum(r.num_tokens_to_compute == 1 for r in self.running)
        capped = self.config.prefill_stretch and self.config.enable_chunked_prefill
        self._prefill_left = self.step_budget.prefill_cap(num_decodes) if capped else None
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, max_seqs)
        if not out.preempted:
            self._schedule_waiting(out, budget, max_seqs)
        return out

    def on_submitted(self, out: SchedulerOutput) -> None:
        """`out` went to the executor: its tokens are in flight, and it holds the blocks it
        writes until `on_collected`, whatever happens to its requests meanwhile."""
        for request, num_new in out.scheduled:
            start = request.num_computed_tokens + request.num_in_flight_tokens
            out.held_blocks += self.kv.hold(request, start, num_new)
            request.num_in_flight_tokens += num_new

    def on_collected(self, out: SchedulerOutput) -> list[tuple[Request, int]]:
        """`out` is back from the executor. Returns the entries whose results apply: a request
        aborted or preempted while in flight loses them (a preempted one recomputes)."""
        for request, num_new in out.scheduled:
            request.num_in_flight_tokens -= num_new
        self.kv.release(out.held_blocks)
        out.held_blocks = []
        return [(r, n) for r, n in out.scheduled if r.status == RequestStatus.RUNNING]

    def on_kv_imported(self, out: SchedulerOutput, kv_import: KVImport, num_imported: int) -> None:
        """The executor wrote the first `num_imported` payloads of `kv_import`. A refused payload
        (other model, corrupt) and the ones after it become a miss: the request sits this step
        out and recomputes them."""
        num_refused = len(kv_import.payloads) - num_imported
        if num_refused == 0:
            return
        self.num_kv_import_failures += 1
        request = kv_import.request
        num_lost = num_refused * self.kv.block_size
        request.num_computed_tokens -= num_lost
        request.num_cached_tokens -= num_lost
        self.kv.record_refused_import(num_lost)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not request]

    def _max_seqs_per_batch(self) -> int:
        """An even share of the requests per batch in flight (all of them with one batch)."""
        num_live = min(len(self._requests), self.config.max_num_seqs)
        return max(1, -(-num_live // self.max_concurrent_batches))

    def _schedule_running(self, out: SchedulerOutput, budget: int, max_seqs: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            request = self.running[i]
            if request.num_tokens_to_compute == 0:  # a batch in flight samples its next token
                i += 1
                continue
            num_new = self._num_to_schedule(request, budget)
            if num_new == 0 and self._prefill_left == 0:  # the decodes after it still run
                i += 1
                continue
            if num_new == 0:
                break
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, max_seqs: int) -> None:
        while (self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.scheduled) < max_seqs):
            request = self._waiting[0][3]
            if self._requests.get(request.request_id) is not request:
                heapq.heappop(self._waiting)  # finished (aborted) while waiting
                continue
            if request.num_in_flight_tokens:  # preempted in flight: waits for its batch
                break
            computed = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = computed.num_tokens
            num_new = self._num_to_schedule(request, budget)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, computed):
                request.num_computed_tokens = 0
                break
            heapq.heappop(self._waiting)
            self._admit(request, computed)
            if computed.external:
                out.kv_imports.append(self._kv_import(request, computed))
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _num_to_schedule(self, request: Request, budget: int) -> int:
        is_prefill = request.num_tokens_to_compute > 1
        if is_prefill and self._prefill_left is not None:
            budget = min(budget, self._prefill_left)
        num_new = min(request.num_tokens_to_compute, budget)
        if num_new < request.num_tokens_to_compute and not self.config.enable_chunked_prefill:
            return 0
        if is_prefill and self._prefill_left is not None:
            self._prefill_left -= num_new
        return num_new

    def _admit(self, request: Request, computed: ComputedBlocks) -> None:
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = computed.num_tokens
            num_external = len(computed.external) * self.kv.block_size
            self.kv.record_lookup(request.num_prompt_tokens, computed.num_tokens - num_external,
                                  num_external)
        request.external_kv = {}  # used once: a preempted request recomputes (or hits locally)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=_priority_key)

    def _kv_import(self, request: Request, computed: ComputedBlocks) -> KVImport:
        first = len(computed.blocks)
        block_ids = self.kv.block_ids(request.request_id)[first : first + len(computed.external)]
        return KVImport(request, block_ids, computed.external)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(
            self._waiting,
            (request.priority, request.arrival_time, next(self._counter), request),
        )

    def check_integrity(self, in_flight: Iterable[SchedulerOutput]) -> None:
        """The running set is running, and each request's tokens in flight are those of the
        batches in flight, within its known tokens."""
        for request in self.running:
            if request.status != RequestStatus.RUNNING:
                raise RuntimeError(f"running_are_running: {request.request_id} is {request.status}")
        num_in_flight: dict[Request, int] = {}
        for out in in_flight:
            for request, num_new in out.scheduled:
                num_in_flight[request] = num_in_flight.get(request, 0) + num_new
        for request in {*self._requests.values(), *num_in_flight}:
            if request.num_in_flight_tokens != num_in_flight.get(request, 0):
                raise RuntimeError(
                    f"in_flight_tokens_match_batches: {request.request_id} counts "
                    f"{request.num_in_flight_tokens}, batches {num_in_flight.get(request, 0)}"
                )
            if request.num_computed_tokens + request.num_in_flight_tokens > request.num_tokens:
                raise RuntimeError(f"in_flight_within_known_tokens: {request.request_id}")


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
