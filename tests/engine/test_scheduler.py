from __future__ import annotations

from engine_fakes import make_request, prompt_of

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.kv_cache_manager import KVCacheManager
from strata.engine.request import Request, RequestStatus
from strata.engine.scheduler import Scheduler, SchedulerOutput
from strata.types import RequestId


def make_scheduler(num_blocks: int = 32, budget: int = 16, max_num_seqs: int = 4,
                   chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks))
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=64, enable_chunked_prefill=chunked)
    return Scheduler(config, kv)


def advance(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """What the engine does after a step: count computed tokens, sample where complete."""
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        sched.kv.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)


def counts(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_flowing() -> None:
    sched = make_scheduler(budget=16)
    short = make_request(prompt_of(3), request_id="short")
    long = make_request(prompt_of(40), request_id="long")
    sched.add(short)
    sched.add(long)
    steps = []
    for _ in range(4):
        out = sched.schedule()
        steps.append(counts(out))
        advance(sched, out)
    assert steps == [
        [("short", 3), ("long", 13)],
        [("short", 1), ("long", 15)],
        [("short", 1), ("long", 12)],
        [("short", 1), ("long", 1)],
    ]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(budget=64, chunked=False)
    a = make_request(prompt_of(40), request_id="a")
    b = make_request(prompt_of(30, start=5), request_id="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert counts(out) == [("a", 40)]  # b does not fit in the rest of the budget
    advance(sched, out)
    assert counts(sched.schedule()) == [("a", 1), ("b", 30)]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(prompt_of(2), request_id=f"q{i}"))
    out = sched.schedule()
    assert counts(out) == [("q0", 2), ("q1", 2)]
    assert sched.num_waiting == 1


def test_priority_then_fcfs_admission() -> None:
    """Higher priority first (the API's polarity, strata.types.PriorityClass), FCFS within."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add(make_request(prompt_of(2), request_id="late-low", priority=-5))
    sched.add(make_request(prompt_of(2), request_id="first"))
    sched.add(make_request(prompt_of(2), request_id="urgent", priority=1))
    sched.add(make_request(prompt_of(2), request_id="second"))
    assert [r for r, _ in counts(sched.schedule())] == ["urgent", "first", "second", "late-low"]


def test_preemption_by_recompute_frees_the_lowest_priority_latest_request() -> None:
    sched = make_scheduler(num_blocks=4, budget=32)
    a = make_request(prompt_of(7), request_id="a")  # 2 blocks
    b = make_request(prompt_of(8), request_id="b")  # 2 blocks, then needs a third to decode
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    advance(sched, out)
    assert counts(out) == [("a", 7), ("b", 8)] and sched.kv.pool.num_free_blocks == 0
    out = sched.schedule()
    # a's next token fits in its second block; b's 9th token needs a new block: b is preempted
    assert counts(out) == [("a", 1)]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_waiting == 1
    sched.kv.check_integrity()


def _finish(sched: Scheduler, request: Request) -> None:
    sched.finish(request, RequestStatus.FINISHED_STOPPED)


def test_finished_requests_release_blocks_and_the_preempted_resume_with_hits() -> None:
    sched = make_scheduler(num_blocks=4, budget=32)
    a, b = make_request(prompt_of(7), request_id="a"), make_request(prompt_of(8), request_id="b")
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    advance(sched, sched.schedule())  # b preempted; its 2 full blocks stay cached
    _finish(sched, a)
    out = sched.schedule()
    # b resumes: its prompt blocks are hits, so only the last known token is recomputed
    assert counts(out) == [("b", 1)] and b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens == 8 and b.num_preemptions == 1
    sched.kv.check_integrity()


def test_a_refused_kv_import_becomes_a_miss_that_the_request_recomputes() -> None:
    """13 tokens, 3 fetched blocks; the executor writes only the first: the scheduler takes the
    request out of this step and the next step computes from block 1 on."""
    sched = make_scheduler(budget=16)
    request = make_request(prompt_of(13), request_id="r")
    hashes = sched.kv.hash_tokens(request.prompt_token_ids, "")
    request.external_kv = {h: f"kv{i}".encode() for i, h in enumerate(hashes)}
    sched.add(request)
    out = sched.schedule()
    assert counts(out) == [("r", 1)]
    (kv_import,) = out.kv_imports
    assert (kv_import.block_ids, kv_import.payloads) == ([0, 1, 2], [b"kv0", b"kv1", b"kv2"])
    sched.on_kv_imported(out, kv_import, 1)
    assert counts(out) == [] and sched.num_kv_import_failures == 1
    assert (request.num_computed_tokens, request.num_cached_tokens) == (4, 4)
    assert sched.kv.num_external_hit_tokens == 4
    advance(sched, out)
    assert counts(sched.schedule()) == [("r", 9)]
    assert sched.kv.block_ids(RequestId("r")) == [0, 1, 2, 3]


def test_a_fully_imported_kv_import_changes_nothing() -> None:
    sched = make_scheduler(budget=16)
    request = make_request(prompt_of(13), request_id="r")
    hashes = sched.kv.hash_tokens(request.prompt_token_ids, "")
    request.external_kv = {h: b"kv" for h in hashes}
    sched.add(request)
    out = sched.schedule()
    sched.on_kv_imported(out, out.kv_imports[0], 3)
    assert counts(out) == [("r", 1)] and sched.num_kv_import_failures == 0
    assert (request.num_computed_tokens, sched.kv.num_external_hit_tokens) == (12, 12)
