"""Continuous batching: decides how many tokens of which requests run in the next step.

The scheduler speaks in token counts, not phases: a decode is 1 token, a prefill chunk is up to the
remaining budget, a prefix hit simply starts a request with `num_computed_tokens > 0`.
Running requests are served first (in priority order); when blocks run out the lowest-priority,
latest-arriving running request is preempted (its blocks freed, recomputed later). Waiting
requests are admitted in priority order (strata/engine/priority.py: higher priority first, FCFS
within one, aging) while budget, sequence slots and blocks last. A waiting request ranked
strictly above running ones takes what it lacks from the lowest of them: their token budget this
step (they sit the step out), then a running slot or blocks (they are preempted, and go back to
the waiting queue under their original arrival time).
A request admitted with fetched KV blocks (see kv_cache_manager) lists them in `kv_imports`:
the engine has the executor import them before the step's forward pass and reports how many it
wrote (`on_kv_imported`); the scheduler turns a refused payload into a miss. A request whose
whole prompt is imported and whose first token a prefill instance handed over is admitted with
nothing to compute (`handed`): the engine appends that token, and it decodes from the next batch.

While decodes run, the chunks of a long prompt (one over the token budget) are capped by the
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

from collections.abc import Iterable
from dataclasses import dataclass, field

from strata.clock import Clock
from strata.engine.block_pool import KVBlock
from strata.engine.config import SchedulerConfig
from strata.engine.integrity import check_scheduler
from strata.engine.kv_cache_manager import ComputedBlocks, KVCacheManager
from strata.engine.priority import WaitingQueue, order_key, to_defer, victims
from strata.engine.request import Request, RequestStatus
from strata.engine.step_budget import StepBudget
from strata.errors import ConfigError
from strata.types import KVPayload, RequestId


@dataclass(frozen=True, slots=True)
class KVImport:
    """Fetched KV to write into `block_ids` of `request` before the forward pass."""

    request: Request
    block_ids: list[int]
    payloads: list[KVPayload]
    num_tokens: int  # the tokens these blocks hold (the last block may be partial)


@dataclass(slots=True)
class SchedulerOutput:
    """Requests to run this step, in batch order, with their number of new tokens. Once
    submitted, the batch holds `held_blocks` (the blocks it writes) until collected."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_imports: list[KVImport] = field(default_factory=list)
    held_blocks: list[KVBlock] = field(default_factory=list)
    handed: list[Request] = field(default_factory=list)  # admitted, nothing to compute

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, *, max_concurrent_batches: int = 1,
        clock: Clock | None = None,
    ) -> None:
        """`clock` gives the time on the clock of `Request.arrival_time`; aging needs it."""
        if config.max_queue_wait_s is not None and clock is None:
            raise ConfigError("max_queue_wait_s (aging) needs the scheduler's clock")
        self.config = config
        self.kv = kv
        self.max_concurrent_batches = max_concurrent_batches
        self.clock = clock
        self.running: list[Request] = []
        self._waiting = WaitingQueue(config.max_queue_wait_s)
        self._requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of them, to make room for a higher priority
        self.num_kv_import_failures = 0
        self.step_budget = StepBudget(
            config.prefill_stretch if config.enable_chunked_prefill else 0.0, floor=16)

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
        self._waiting.push(request, request.arrival_time)

    def get(self, request_id: RequestId) -> Request | None:
        return self._requests.get(request_id)

    def lora_digests(self) -> set[str]:
        """The LoRA adapters the unfinished requests run with."""
        return {r.lora_digest for r in self._requests.values() if r.lora_digest}

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the scheduler with a final status and free its blocks."""
        request.status = status
        if request.timeline is not None:
            request.timeline.finished(status.name.lower())
        self._requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)  # waiting requests are skipped lazily when popped

    def schedule(self) -> SchedulerOutput:
        now = self.clock() if self.clock is not None else 0.0
        out = SchedulerOutput()
        max_seqs = self._max_seqs_per_batch()
        self.step_budget.start_step(sum(r.num_tokens_to_compute == 1 for r in self.running))
        self._schedule_running(out, self.config.max_num_batched_tokens, max_seqs, now)
        if not out.preempted:
            self._schedule_waiting(out, max_seqs, now)
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
        num_lost = kv_import.num_tokens - num_imported * self.kv.block_size
        request.num_computed_tokens -= num_lost
        request.num_cached_tokens -= num_lost
        self.kv.record_refused_import(num_lost)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not request]

    def _max_seqs_per_batch(self) -> int:
        """An even share of the requests per batch in flight (all of them with one batch)."""
        num_live = min(len(self._requests), self.config.max_num_seqs)
        return max(1, -(-num_live // self.max_concurrent_batches))

    def _schedule_running(self, out: SchedulerOutput, budget: int, max_seqs: int,
                          now: float) -> None:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            request = self.running[i]
            if request.num_tokens_to_compute == 0:  # a batch in flight samples its next token
                i += 1
                continue
            if not self._lora_fits(request, out):  # its adapter waits for a free one
                i += 1
                continue
            num_new = self._num_to_schedule(request, budget)
            if num_new == 0 and self.step_budget.left != 0:
                break
            if num_new == 0:  # a prefill over the cap: the decodes after it still run
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out, now)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1

    def _schedule_waiting(self, out: SchedulerOutput, max_seqs: int, now: float) -> None:
        while True:
            request = self._waiting.peek(now)
            if request is None:
                break
            if self._requests.get(request.request_id) is not request:
                self._waiting.pop(request, now)  # finished (aborted) while waiting
                continue
            if request.num_in_flight_tokens:  # preempted in flight: waits for its batch
                break
            if not self._lora_fits(request, out):  # FIFO: nothing overtakes it
                break
            if not self._try_admit(request, out, max_seqs, now):
                break

    def _lora_fits(self, request: Request, out: SchedulerOutput) -> bool:
        """Whether the request's LoRA adapter (if any) may join the step: it is already in it,
        or fewer than `max_loras` adapters are. The running list is in admission order, so
        the earliest requests' adapters go first and a deferred one gets the next free place."""
        limit = self.config.max_loras
        if limit is None or not request.lora_digest:
            return True
        adapters = {r.lora_digest for r, _ in out.scheduled if r.lora_digest}
        return request.lora_digest in adapters or len(adapters) < limit

    def _try_admit(self, request: Request, out: SchedulerOutput, max_seqs: int,
                   now: float) -> bool:
        """Admit `request` if it can run this step (making room below it); else change nothing."""
        computed = self.kv.get_computed_blocks(request)
        request.num_computed_tokens = computed.num_tokens
        is_handed = request.num_tokens_to_compute == 0  # see the module docstring
        before = list(out.scheduled)
        if not is_handed:  # a handed request takes a running slot, not a seat in this batch
            self._defer_lower(request, out, max_seqs)
        budget = self.config.max_num_batched_tokens - out.num_tokens
        num_new = self._num_to_schedule(request, budget) if budget > 0 else 0
        if (not is_handed and (num_new == 0 or len(out.scheduled) >= max_seqs)) \
                or not self._make_room(request, num_new, computed, out, now) \
                or not self.kv.allocate_slots(request, num_new, computed):
            request.num_computed_tokens = 0
            out.scheduled = [(r, n) for r, n in before if r.status == RequestStatus.RUNNING]
            return False
        self._waiting.pop(request, now)
        self._admit(request, computed)
        if computed.external:
            out.kv_imports.append(self._kv_import(request, computed))
        if is_handed:
            out.handed.append(request)
        else:
            out.scheduled.append((request, num_new))
        return True

    def _defer_lower(self, request: Request, out: SchedulerOutput, max_seqs: int) -> None:
        """Take this step's seats and budget back from entries ranked below `request`
        (priority.to_defer) so that it has a seat in the batch and budget for its tokens."""
        num_short = out.num_tokens + request.num_tokens_to_compute \
            - self.config.max_num_batched_tokens
        taken = to_defer(request, out.scheduled, num_tokens_short=num_short,
                         num_seats_short=len(out.scheduled) + 1 - max_seqs,
                         may_split=self.config.enable_chunked_prefill)
        out.scheduled = [(r, n - taken.get(r, 0)) for r, n in out.scheduled
                         if n > taken.get(r, 0)]

    def _make_room(self, request: Request, num_new: int, computed: ComputedBlocks,
                   out: SchedulerOutput, now: float) -> bool:
        """Preempt what `request` needs for a slot and `num_new` tokens (priority.victims)."""
        chosen = victims(request, self.running,
                         needs_slot=len(self.running) >= self.config.max_num_seqs,
                         num_blocks_short=self.kv.num_blocks_short(request, num_new, computed),
                         num_freeable=self.kv.num_freeable)
        for victim in chosen or ():
            self._preempt(victim, out, now)
            self.num_priority_preemptions += 1
        return chosen is not None

    def _num_to_schedule(self, request: Request, budget: int) -> int:
        to_go = request.num_tokens_to_compute
        is_long = request.num_tokens > self.config.max_num_batched_tokens  # see step_budget.py
        num_new = min(to_go, self.step_budget.limit(to_go, budget, is_long=is_long))
        if num_new < to_go and (request.is_pooling or not self.config.enable_chunked_prefill):
            return 0
        return num_new

    def _admit(self, request: Request, computed: ComputedBlocks) -> None:
        if request.status == RequestStatus.WAITING:  # a resumed request looks up its outputs too
            request.num_cached_tokens = min(computed.num_tokens, request.num_prompt_tokens)
            num_local = len(computed.blocks) * self.kv.block_size
            self.kv.record_lookup(request.num_tokens, num_local, computed.num_tokens - num_local)
        request.external_kv = {}  # used once: a preempted request recomputes (or hits locally)
        request.status = RequestStatus.RUNNING
        if request.timeline is not None:
            request.timeline.admitted()
        self.running.append(request)
        self.running.sort(key=order_key)

    def _kv_import(self, request: Request, computed: ComputedBlocks) -> KVImport:
        first = len(computed.blocks)
        block_ids = self.kv.block_ids(request.request_id)[first : first + len(computed.external)]
        num_tokens = computed.num_tokens - first * self.kv.block_size
        return KVImport(request, block_ids, computed.external, num_tokens)

    def _preempt(self, request: Request, out: SchedulerOutput, now: float) -> None:
        self.running.remove(request)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not request]
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.timeline is not None:
            request.timeline.preempted()
        self.num_preemptions += 1
        out.preempted.append(request)
        self._waiting.push(request, now)  # under its original arrival: it keeps its place

    def check_integrity(self, in_flight: Iterable[SchedulerOutput]) -> None:
        """See strata.engine.integrity; RuntimeError naming a broken invariant."""
        check_scheduler(self.running, self._requests.values(), (o.scheduled for o in in_flight))
