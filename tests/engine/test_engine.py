from __future__ import annotations

import pytest
from engine_fakes import (
    ALPHABET,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason
from strata.errors import ContextLengthError, InvalidRequestError, OverloadedError
from strata.types import RequestId

MIXED_LENGTHS = [3, 17, 40, 5, 64, 1, 33, 9, 12, 28, 50, 2, 7, 19, 44, 30]


def collect(engine_outputs: list[RequestOutput], into: dict[str, list[RequestOutput]]) -> None:
    for out in engine_outputs:
        into.setdefault(out.request_id, []).append(out)


def test_a_request_alone_matches_the_reference() -> None:
    engine, _ = make_engine()
    req = make_request(prompt_of(10), max_tokens=12)
    engine.add_request(req)
    assert run_to_completion(engine)[req.request_id] == reference_tokens(prompt_of(10), 12)
    assert req.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
        {"max_num_batched_tokens": 16},  # heavy chunking
        {"num_blocks": 40},  # forces preemptions
    ],
    ids=["default", "no-prefix-cache", "no-chunking", "small-budget", "preemption"],
)
def test_batch_of_16_mixed_lengths_gives_each_request_its_solo_tokens(options: dict) -> None:
    engine, executor = make_engine(max_num_seqs=16, **options)
    requests = [make_request(prompt_of(n, start=n), max_tokens=20) for n in MIXED_LENGTHS]
    for r in requests:
        engine.add_request(r)
    got = run_to_completion(engine)
    for r, n in zip(requests, MIXED_LENGTHS, strict=True):
        assert got[r.request_id] == reference_tokens(prompt_of(n, start=n), 20), n
    assert max(executor.batch_sizes) > 1
    if options.get("num_blocks") == 40:
        assert engine.stats().num_preemptions > 0


def test_shared_prefix_is_computed_once_and_counted_as_hits() -> None:
    engine, executor = make_engine(block_size=4)
    system = prompt_of(32)
    first = make_request(system + [1, 2, 3], max_tokens=2)
    engine.add_request(first)
    run_to_completion(engine)
    second = make_request(system + [4, 5, 6], max_tokens=2)
    engine.add_request(second)
    tokens = run_to_completion(engine)
    assert tokens[second.request_id] == reference_tokens(system + [4, 5, 6], 2)
    assert second.num_cached_tokens == 32
    assert executor.num_tokens_per_step[-2] == 3  # only the unique suffix was prefilled
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (70, 32)


def test_cache_salt_isolates_tenants() -> None:
    engine, _ = make_engine()
    engine.add_request(make_request(prompt_of(20), max_tokens=1, cache_salt="a"))
    run_to_completion(engine)
    other = make_request(prompt_of(20), max_tokens=1, cache_salt="b")
    engine.add_request(other)
    run_to_completion(engine)
    assert other.num_cached_tokens == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    alone, _ = make_engine()
    req = make_request(prompt_of(6), max_tokens=10, temperature=0.8, seed=42)
    alone.add_request(req)
    solo = run_to_completion(alone)[req.request_id]
    busy, _ = make_engine()
    same = make_request(prompt_of(6), max_tokens=10, temperature=0.8, seed=42)
    for n in (5, 9, 30):
        busy.add_request(make_request(prompt_of(n, start=3), max_tokens=7))
    busy.add_request(same)
    assert run_to_completion(busy)[same.request_id] == solo
    assert solo == reference_tokens(prompt_of(6), 10, 42)


def test_stop_string_cuts_text_and_is_never_streamed() -> None:
    prompt = prompt_of(5)
    text = "".join(ALPHABET[t] for t in reference_tokens(prompt, 12))
    stop = text[6:9]
    engine, _ = make_engine()
    req = make_request(prompt, max_tokens=12, stop=(stop,))
    engine.add_request(req)
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        collect(engine.step(), outs)
    streamed = "".join(o.new_text for o in outs[req.request_id])
    assert streamed == text[: text.index(stop)]
    last = outs[req.request_id][-1]
    assert last.finished and last.finish_reason == FinishReason.STOP and last.stop_reason == stop
    engine.check_integrity()


def test_eos_stops_unless_ignored_and_stop_token_ids_stop() -> None:
    prompt = prompt_of(4)
    ref = reference_tokens(prompt, 6)
    engine, _ = make_engine()
    by_id = make_request(prompt, max_tokens=6, stop_token_ids=(ref[2],))
    engine.add_request(by_id)
    run_to_completion(engine)
    assert by_id.output_token_ids == ref[:3] and by_id.stop_reason == ref[2]
    assert by_id.finish_reason == FinishReason.STOP
    eos = make_request(prompt, max_tokens=6)
    eos.eos_token_ids = (ref[1],)
    ignoring = make_request(prompt, max_tokens=6, ignore_eos=True)
    ignoring.eos_token_ids = (ref[1],)
    engine.add_request(eos)
    engine.add_request(ignoring)
    run_to_completion(engine)
    assert eos.output_token_ids == ref[:2] and eos.finish_reason == FinishReason.STOP
    assert eos.stop_reason is None
    assert ignoring.output_token_ids == ref and ignoring.finish_reason == FinishReason.LENGTH


def test_abort_frees_blocks_at_once() -> None:
    engine, _ = make_engine()
    req = make_request(prompt_of(30), max_tokens=50)
    engine.add_request(req)
    engine.step()
    assert engine.stats().num_running == 1
    engine.abort_request(req.request_id)
    engine.abort_request(req.request_id)  # idempotent
    assert engine.stats().num_running == 0 and engine.stats().kv_usage == 0.0
    assert req.finish_reason == FinishReason.ABORT
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_abort_while_waiting_is_skipped() -> None:
    engine, _ = make_engine(max_num_seqs=1)
    first = make_request(prompt_of(3), max_tokens=3)
    second = make_request(prompt_of(4), max_tokens=3)
    engine.add_request(first)
    engine.add_request(second)
    engine.abort_request(second.request_id)
    assert set(run_to_completion(engine)) == {first.request_id}


def test_validation_errors_name_the_numbers() -> None:
    engine, _ = make_engine(max_model_len=32, max_waiting=1)
    with pytest.raises(ContextLengthError, match="32 tokens.*40 tokens"):
        engine.add_request(make_request(prompt_of(40)))
    with pytest.raises(ContextLengthError, match="max_tokens is 20"):
        engine.add_request(make_request(prompt_of(20), max_tokens=20))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(make_request([]))
    with pytest.raises(InvalidRequestError, match=r"\[0, 64\)"):
        engine.add_request(make_request([1, 99]))
    engine.add_request(make_request(prompt_of(3)))
    with pytest.raises(OverloadedError):
        engine.add_request(make_request(prompt_of(3)))
    assert not engine.scheduler.get(RequestId("nope"))


def test_max_model_len_ends_generation_with_length() -> None:
    engine, _ = make_engine(max_model_len=12)
    req = make_request(prompt_of(8), max_tokens=4)
    engine.add_request(req)
    assert len(run_to_completion(engine)[req.request_id]) == 4
    assert req.finish_reason == FinishReason.LENGTH


def test_logprobs_are_attached_when_asked() -> None:
    engine, _ = make_engine()
    req = make_request(prompt_of(3), max_tokens=3, logprobs=0)
    engine.add_request(req)
    run_to_completion(engine)
    assert [lp.token_id for lp in req.output_logprobs] == req.output_token_ids
