"""The engine's phases of a request as plain data (strata/engine/timeline.py), on a clock that
ticks once per reading, and the spans the server makes of them (strata/server/phase_spans.py)."""

from __future__ import annotations

import itertools

from engine_fakes import make_engine, make_request, prompt_of, run_to_completion
from span_tree import Spans, ancestors

from strata.engine.request import Request
from strata.engine.timeline import PhaseTimeline
from strata.server.phase_spans import emit


def timed(request: Request) -> PhaseTimeline:
    ticks = itertools.count(1000)
    request.timeline = PhaseTimeline(clock_ns=lambda: next(ticks))
    return request.timeline


def test_a_chunked_prompt_is_three_chunks_then_a_decode_of_five_tokens() -> None:
    engine, _ = make_engine(max_num_batched_tokens=16)
    request = make_request(prompt_of(40), max_tokens=5)
    timeline = timed(request)
    engine.add_request(request)
    run_to_completion(engine)
    assert timeline.arrived_ns == 1000
    assert timeline.admitted_ns is not None and timeline.admitted_ns > timeline.arrived_ns
    assert [c.num_tokens for c in timeline.chunks] == [16, 16, 8]
    assert all(c.start_ns < c.end_ns for c in timeline.chunks)  # submitted, then collected
    assert timeline.first_token_ns is not None and timeline.first_token_ns > \
        timeline.chunks[-1].end_ns
    assert timeline.num_tokens == 5 and timeline.finish == "finished_length"
    assert timeline.preemptions == [] and timeline.imports == []


def test_a_request_without_a_timeline_is_not_stamped() -> None:
    engine, _ = make_engine()
    request = make_request(prompt_of(8), max_tokens=3)
    engine.add_request(request)
    run_to_completion(engine)
    assert request.timeline is None


def test_a_preempted_request_recomputes_and_its_phases_become_spans(spans: Spans) -> None:
    """Two requests that outgrow six blocks together: the later one is preempted, admitted
    again once the first is done, and recomputes its tokens in one chunk."""
    engine, _ = make_engine(num_blocks=6, block_size=4)
    first, later = make_request(prompt_of(8), max_tokens=12), \
        make_request(prompt_of(8, start=3), max_tokens=12)
    timelines = [timed(first), timed(later)]
    for request in (first, later):
        engine.add_request(request)
    run_to_completion(engine)
    assert timelines[0].preemptions == []
    (preempted_at, readmitted_at), = timelines[1].preemptions
    assert readmitted_at is not None and readmitted_at > preempted_at
    recomputed = [c for c in timelines[1].chunks if c.start_ns > readmitted_at]
    assert len(recomputed) == 1 and recomputed[0].num_tokens > 8  # prompt and sampled tokens
    assert timelines[1].num_tokens == 12 and later.num_preemptions == 1

    emit(later, timelines[1])
    got = spans.all()
    root, = (s for s in got if s.name == "strata.engine.request")
    assert root.attributes is not None and root.attributes["strata.engine.num_preemptions"] == 1
    assert sorted(s.name for s in got if s is not root) == [
        "strata.engine.decode", "strata.engine.preempted", "strata.engine.prefill_chunk",
        "strata.engine.prefill_chunk", "strata.engine.queue_wait"]
    assert all(ancestors(s, got) == ["strata.engine.request"] for s in got if s is not root)
    preempted, = (s for s in got if s.name == "strata.engine.preempted")
    assert (preempted.start_time, preempted.end_time) == (preempted_at, readmitted_at)
