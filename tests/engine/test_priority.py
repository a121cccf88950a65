"""Priority stories: the scheduler with exact counts, the engine with fake executors and an
injected clock. Higher priority = more important (strata.types.PriorityClass)."""

from __future__ import annotations

from engine_fakes import (
    PipelineFakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.clock import ManualClock
from strata.engine import priority
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.scheduler import Scheduler, SchedulerOutput
from strata.types import PriorityClass, RequestId

INTERACTIVE, STANDARD = PriorityClass.INTERACTIVE, PriorityClass.STANDARD
BATCH, SHEDDABLE = PriorityClass.BATCH, PriorityClass.SHEDDABLE


def make_scheduler(*, num_blocks: int = 32, budget: int = 16, max_num_seqs: int = 4,
                   max_queue_wait_s: float | None = None,
                   clock: ManualClock | None = None) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks))
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=64, max_queue_wait_s=max_queue_wait_s)
    return Scheduler(config, kv, clock=clock or ManualClock())


def request(name: str, priority: int, length: int = 3, at: float | None = None,
            max_tokens: int = 8) -> Request:
    r = make_request(prompt_of(length, start=len(name) * 5 + ord(name[-1])), max_tokens,
                     request_id=name, priority=priority)
    if at is not None:
        r.arrival_time = at
    return r


def step(sched: Scheduler) -> SchedulerOutput:
    """Schedule, then do what the engine does: count computed tokens, sample where complete."""
    out = sched.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        sched.kv.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(1)
    sched.kv.check_integrity()
    sched.check_integrity([])
    return out


def counts(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def names(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_an_interactive_request_preempts_the_latest_batch_one_at_the_slot_cap() -> None:
    sched = make_scheduler(max_num_seqs=2)
    b1, b2 = request("b1", BATCH), request("b2", BATCH)
    sched.add(b1)
    sched.add(b2)
    assert counts(step(sched)) == [("b1", 3), ("b2", 3)]
    sched.add(i1 := request("i1", INTERACTIVE))
    out = step(sched)
    assert counts(out) == [("b1", 1), ("i1", 3)]  # b2's decode leaves this step with it
    assert names(out.preempted) == ["b2"] and b2.status == RequestStatus.PREEMPTED
    sched.add(request("i2", INTERACTIVE))
    out = step(sched)
    assert counts(out) == [("i1", 1), ("i2", 3)] and names(out.preempted) == ["b1"]
    sched.add(request("i3", INTERACTIVE))
    out = step(sched)  # nothing running ranks below i3: equal priorities never preempt
    assert counts(out) == [("i1", 1), ("i2", 1)] and out.preempted == []
    assert (sched.num_preemptions, sched.num_priority_preemptions) == (2, 2)
    assert i1.num_preemptions == 0


def test_a_preempted_request_keeps_its_original_place_in_the_queue() -> None:
    """b2 was running when b3 arrived; preempted later, b2 still goes before b3."""
    sched = make_scheduler(max_num_seqs=2)
    b1, b2, b3 = request("b1", BATCH, at=1), request("b2", BATCH, at=2), request("b3", BATCH, at=3)
    for r in (b1, b2, b3):
        sched.add(r)
    step(sched)
    i = request("i", INTERACTIVE, at=4)
    sched.add(i)
    assert names(step(sched).preempted) == ["b2"]
    sched.finish(i, RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert counts(out) == [("b1", 1), ("b2", 4)]  # b2 recomputes its 4 tokens
    assert b3.status == RequestStatus.WAITING and sched.num_waiting == 1


def test_under_kv_pressure_a_higher_priority_request_takes_the_lowest_ones_blocks() -> None:
    sched = make_scheduler(num_blocks=4, budget=32, max_num_seqs=8)
    b1, b2 = request("b1", BATCH, length=7), request("b2", STANDARD, length=7)
    sched.add(b1)
    sched.add(b2)
    step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    sched.add(request("s", STANDARD, length=3))
    out = step(sched)  # s outranks only b1 (b2 is its equal): b1 is preempted for its block
    assert counts(out) == [("b2", 1), ("s", 3)] and names(out.preempted) == ["b1"]
    sched.add(request("s2", STANDARD, length=3))
    out = step(sched)  # no block, and nothing below s2 to take one from: it waits
    assert counts(out) == [("b2", 1), ("s", 1)] and out.preempted == []


def test_no_preemption_when_even_every_lower_request_would_not_free_enough() -> None:
    sched = make_scheduler(num_blocks=4, budget=32, max_num_seqs=8)
    sched.add(b := request("b", BATCH, length=3))
    sched.add(s := request("s", STANDARD, length=11))
    step(sched)
    sched.add(request("t", STANDARD, length=15))  # 4 blocks; b would free only 1
    out = step(sched)
    assert out.preempted == [] and b.status == RequestStatus.RUNNING
    assert counts(out) == [("s", 1), ("b", 1)] and s.num_preemptions == 0


def test_a_lower_prompt_chunk_gives_budget_back_to_a_higher_request() -> None:
    sched = make_scheduler(budget=16, max_num_seqs=4)
    sched.add(b := request("b", BATCH, length=40))
    assert counts(step(sched)) == [("b", 16)]
    sched.add(request("i", INTERACTIVE, length=3))
    out = step(sched)
    assert counts(out) == [("b", 13), ("i", 3)] and out.preempted == []
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 0
    assert counts(step(sched)) == [("i", 1), ("b", 11)]


def test_aging_lifts_a_waiting_batch_request_above_newer_standard_ones() -> None:
    clock = ManualClock(100.0)
    sched = make_scheduler(max_num_seqs=1, max_queue_wait_s=5.0, clock=clock)
    s1 = request("s1", STANDARD, at=100.0, max_tokens=50)
    sched.add(s1)
    step(sched)
    sched.add(request("b", BATCH, at=100.5))
    sched.add(request("shed", SHEDDABLE, at=100.5))
    clock.set(101.0)
    sched.add(request("s2", STANDARD, at=101.0))
    assert counts(step(sched)) == [("s1", 1)]  # the slot is full; none outranks s1 yet
    clock.set(105.5)  # b has waited 5 s: it ranks with the top class and takes the slot
    out = step(sched)
    assert counts(out) == [("b", 3)] and names(out.preempted) == ["s1"]
    clock.set(200.0)  # every waiting request has aged now, except the sheddable one
    out = step(sched)
    assert [priority.rank(sched.get(RequestId(n))) for n in ("b", "s1", "s2", "shed")] \
        == [INTERACTIVE, INTERACTIVE, INTERACTIVE, SHEDDABLE]
    assert counts(out) == [("b", 1)]  # aged equals never preempt each other


def test_aging_counts_only_the_time_spent_waiting() -> None:
    """Time running does not age a request; a preempted one resumes its count."""
    clock = ManualClock()
    sched = make_scheduler(max_num_seqs=1, max_queue_wait_s=10.0, clock=clock)
    b = request("b", BATCH, at=0.0, max_tokens=60)
    sched.add(b)
    clock.set(4.0)
    step(sched)  # b waited 4 s, then runs
    clock.set(30.0)
    assert not b.is_aged and b.waited_s == 4.0
    sched.add(request("i", INTERACTIVE, at=30.0, max_tokens=60))
    assert names(step(sched).preempted) == ["b"]
    clock.set(35.9)
    step(sched)
    assert not b.is_aged  # 4 s + 5.9 s of waiting
    clock.set(36.0)
    step(sched)
    assert b.is_aged and priority.rank(b) == INTERACTIVE  # and i, its equal, keeps the slot
    assert sched.running[0].request_id == "i" and b.status == RequestStatus.PREEMPTED


def test_equal_priorities_never_preempt_each_other_in_the_engine() -> None:
    engine, _ = make_engine(max_num_seqs=2, num_blocks=64)
    for k in range(6):
        engine.add_request(make_request(prompt_of(5, start=k), max_tokens=6,
                                        request_id=f"s{k}", priority=STANDARD))
    run_to_completion(engine)
    assert engine.stats().num_preemptions == 0


def test_a_waiting_batch_request_is_served_within_the_aging_bound() -> None:
    """A stream of standard requests keeps one slot busy; the batch request behind them gets
    its first token within max_queue_wait_s plus one request's service, and never without
    aging."""
    for max_wait_s, expected in ((2.0, True), (None, False)):
        clock = ManualClock()
        engine, _ = make_engine(max_num_seqs=1, max_queue_wait_s=max_wait_s, clock=clock)
        first_token_at = _run_stream_with_one_batch_request(engine, clock)
        assert (first_token_at is not None and first_token_at <= 2.0 + 1.0) is expected


def _run_stream_with_one_batch_request(engine: Engine, clock: ManualClock) -> float | None:
    batch = make_request(prompt_of(4), max_tokens=4, request_id="batch", priority=BATCH)
    batch.arrival_time = 0.0
    engine.add_request(batch)
    for k in range(200):  # 0.1 s a step; a new 5-token standard request every 0.5 s
        if k % 5 == 0:
            s = make_request(prompt_of(3, start=k), max_tokens=5, request_id=f"s{k}")
            s.arrival_time = clock()
            engine.add_request(s)
        for out in engine.step():
            if out.request_id == "batch":
                return clock()
        engine.check_integrity()
        clock.advance(0.1)
    return None


def test_priority_preemption_with_batches_in_flight_keeps_every_answer_exact() -> None:
    """Two pipeline stages; interactive requests arrive while batch ones fill both slots. The
    fake executor checks the in-flight rules; the tokens match a solo run."""
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(max_num_seqs=2, executor=executor, num_blocks=24)
    prompts = {f"b{k}": prompt_of(6, start=k) for k in range(3)}
    for name, prompt in prompts.items():
        engine.add_request(make_request(prompt, max_tokens=10, request_id=name, priority=BATCH))
    tokens: dict[RequestId, list[int]] = {}
    first_output: dict[str, int] = {}
    for k in range(400):
        if k in (3, 4):
            name = f"i{k}"
            prompts[name] = prompt_of(5, start=20 + k)
            engine.add_request(make_request(prompts[name], max_tokens=4, request_id=name,
                                            priority=INTERACTIVE))
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            first_output.setdefault(out.request_id, k)
        engine.check_integrity()
    assert {r: tokens[RequestId(r)] for r in prompts} == {
        r: reference_tokens(p, 10 if r.startswith("b") else 4) for r, p in prompts.items()}
    assert engine.stats().num_priority_preemptions >= 1
    last_interactive = max(first_output["i3"], first_output["i4"])
    assert last_interactive < min(k for r, k in first_output.items() if r == "b2")
