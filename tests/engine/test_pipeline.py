"""Batches in flight (pipeline parallel) over a fake of P pipeline stages.

`PipelineFakeExecutor` gives each stage its own KV, moves batches one stage per tick and fails
if the engine submits a request before its sampled token is back or hands a block that a batch
in flight writes to another request. Each story gives the exact batches, block ids and outputs.
"""

from __future__ import annotations

import asyncio
from array import array

import pytest
from engine_fakes import (
    ALPHABET,
    KV_TAG,
    FakeExecutor,
    KVPipelineFakeExecutor,
    PipelineFakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.engine import Engine
from strata.engine.executor import AsyncModelExecutor
from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason, RequestStatus
from strata.errors import ConfigError
from strata.server.async_engine import AsyncEngine

MIXED_LENGTHS = [3, 17, 40, 5, 64, 1, 33, 9, 12, 28, 50, 2, 7, 19, 44, 30]


def news(outputs: list[RequestOutput]) -> list[tuple[str, int, bool]]:
    return [(o.request_id, len(o.new_token_ids), o.finished) for o in outputs]


def steps(engine: Engine, num: int) -> list[tuple[list[tuple[str, int, bool]], int]]:
    """(news, batches still in flight) of `num` steps, checking integrity after each."""
    seen = []
    for _ in range(num):
        outputs = engine.step()
        engine.check_integrity()
        seen.append((news(outputs), engine.stats().num_batches_in_flight))
    return seen


def test_the_fake_is_an_async_executor_and_the_plain_one_is_not() -> None:
    assert isinstance(PipelineFakeExecutor(2), AsyncModelExecutor)
    assert not isinstance(FakeExecutor(), AsyncModelExecutor)
    with pytest.raises(ConfigError, match="max_concurrent_batches must be >= 1, got 0"):
        make_engine(executor=PipelineFakeExecutor(2, max_concurrent_batches=0))


def test_two_requests_alternate_between_two_batches_in_flight() -> None:
    """Each batch takes half the requests, so while stage 1 runs one request's batch, stage 0
    runs the other's: 6 batches through 2 stages in 7 ticks instead of 12."""
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(executor=executor)
    r0 = make_request(prompt_of(5), 3, request_id="r0")
    r1 = make_request(prompt_of(6, start=2), 3, request_id="r1")
    engine.add_request(r0)
    engine.add_request(r1)
    assert steps(engine, 6) == [
        ([("r0", 1, False)], 1),
        ([("r1", 1, False)], 1),
        ([("r0", 1, False)], 1),
        ([("r1", 1, False)], 1),
        ([("r0", 1, True)], 1),
        ([("r1", 1, True)], 0),
    ]
    assert executor.batches == [
        [("r0", 0, 5)], [("r1", 0, 6)], [("r0", 5, 1)], [("r1", 6, 1)], [("r0", 6, 1)],
        [("r1", 7, 1)],
    ]
    assert (executor.num_ticks, executor.stage_busy_ticks, executor.max_in_flight) == (7, [6, 6], 2)
    assert not engine.has_unfinished_requests()
    assert r0.output_token_ids == reference_tokens(prompt_of(5), 3)
    assert r1.output_token_ids == reference_tokens(prompt_of(6, start=2), 3)


def test_three_batches_in_flight_over_three_stages() -> None:
    executor = PipelineFakeExecutor(num_stages=3)
    engine, _ = make_engine(executor=executor)
    prompts = {f"r{i}": prompt_of(4 + i, start=i) for i in range(3)}
    requests = [make_request(prompt, 2, request_id=rid) for rid, prompt in prompts.items()]
    for request in requests:
        engine.add_request(request)
    assert steps(engine, 6) == [
        ([("r0", 1, False)], 2),
        ([("r1", 1, False)], 2),
        ([("r2", 1, False)], 2),
        ([("r0", 1, True)], 2),
        ([("r1", 1, True)], 1),
        ([("r2", 1, True)], 0),
    ]
    assert executor.batches == [
        [("r0", 0, 4)], [("r1", 0, 5)], [("r2", 0, 6)],
        [("r0", 4, 1)], [("r1", 5, 1)], [("r2", 6, 1)],
    ]
    assert (executor.num_ticks, executor.max_in_flight) == (8, 3)  # 6 batches + 2 to drain
    for request in requests:
        assert request.output_token_ids == reference_tokens(prompts[request.request_id], 2)


def test_a_decoding_request_is_never_in_two_batches_at_once() -> None:
    """Alone, a request cannot fill the pipeline: each decode needs the token of the last."""
    executor = PipelineFakeExecutor(num_stages=3)
    engine, _ = make_engine(executor=executor)
    request = make_request(prompt_of(5), 3, request_id="solo")
    engine.add_request(request)
    assert steps(engine, 3) == [([("solo", 1, False)], 0), ([("solo", 1, False)], 0),
                                ([("solo", 1, True)], 0)]
    assert executor.batches == [[("solo", 0, 5)], [("solo", 5, 1)], [("solo", 6, 1)]]
    assert (executor.num_ticks, executor.max_in_flight) == (9, 1)
    assert request.output_token_ids == reference_tokens(prompt_of(5), 3)


def test_a_prompt_is_chunked_across_batches_in_flight_and_cached_as_they_return() -> None:
    """The prompt is known, so its chunks go out back to back; a block enters the prefix cache
    only once the batch that wrote it is back."""
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(executor=executor, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = prompt_of(20)
    request = make_request(prompt, 3, request_id="long")
    engine.add_request(request)
    hashes = engine.block_hashes(prompt)
    cached = []
    seen = []
    for _ in range(5):
        seen.append(news(engine.step()))
        engine.check_integrity()
        cached.append(engine.num_cached_blocks(hashes))
    assert executor.batches == [
        [("long", 0, 8)], [("long", 8, 8)], [("long", 16, 4)], [("long", 20, 1)],
        [("long", 21, 1)],
    ]
    assert seen == [[], [], [("long", 1, False)], [("long", 1, False)], [("long", 1, True)]]
    assert cached == [2, 4, 5, 5, 5]
    assert executor.max_in_flight == 2
    assert request.output_token_ids == reference_tokens(prompt, 3)


def test_abort_in_flight_keeps_the_written_blocks_until_the_batch_is_back() -> None:
    """r1 is aborted while its batch is in flight: its output is dropped and the blocks that
    batch writes (2, 3) stay out of the free queue, so r2 waits for them rather than get them
    while they are still written."""
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(executor=executor, num_blocks=5, block_size=4)
    r0 = make_request(prompt_of(6), 1, request_id="r0")
    r1 = make_request(prompt_of(6, start=3), 4, request_id="r1")
    engine.add_request(r0)
    engine.add_request(r1)
    assert steps(engine, 1) == [([("r0", 1, True)], 1)]  # r0 done; r1's prefill in flight
    assert engine.kv.pool.free_queue.block_ids() == [4, 1, 0]
    engine.abort_request(r1.request_id)
    engine.check_integrity()
    assert r1.finish_reason == FinishReason.ABORT
    assert engine.kv.pool.free_queue.block_ids() == [4, 1, 0]  # 2 and 3 are held in flight
    assert engine.has_unfinished_requests()  # the batch is still to collect
    r2 = make_request(prompt_of(13, start=5), 2, request_id="r2")  # needs 4 blocks
    engine.add_request(r2)
    assert steps(engine, 1) == [([], 0)]  # r2 waited; r1's batch came back, its news dropped
    assert engine.kv.pool.free_queue.block_ids() == [4, 1, 0, 3, 2]
    assert steps(engine, 2) == [([("r2", 1, False)], 0), ([("r2", 1, True)], 0)]
    assert executor.batches[2:] == [[("r2", 0, 13)], [("r2", 13, 1)]]
    assert engine.kv.pool.free_queue.block_ids()[-4:] == [3, 0, 1, 4]  # r2 had 4, 1, 0, 3
    assert r2.output_token_ids == reference_tokens(prompt_of(13, start=5), 2)
    assert not engine.has_unfinished_requests()


def test_fetched_kv_never_lands_in_a_block_that_a_batch_in_flight_still_writes() -> None:
    """r1 is aborted when its batch has run stage 0 but not stage 1, which will still write
    blocks 2 and 3. r2 brings fetched KV for 4 blocks and needs 5: it waits for r1's batch,
    then imports into 4, 1, 0, 3 (the fake fails an import into a block written in flight)."""
    executor = KVPipelineFakeExecutor(2)
    engine, _ = make_engine(executor=executor, num_blocks=5, block_size=4)
    r0 = make_request(prompt_of(6), 1, request_id="r0")
    r1 = make_request(prompt_of(6, start=3), 4, request_id="r1")
    engine.add_request(r0)
    engine.add_request(r1)
    assert steps(engine, 1) == [([("r0", 1, True)], 1)]
    engine.abort_request(r1.request_id)
    prompt = prompt_of(17, start=5)
    r2 = make_request(prompt, 2, request_id="r2")
    r2.external_kv = {h: KV_TAG + array("q", prompt[4 * i : 4 * i + 4]).tobytes()
                      for i, h in enumerate(engine.block_hashes(prompt))}
    engine.add_request(r2)
    assert steps(engine, 3) == [([], 0), ([("r2", 1, False)], 0), ([("r2", 1, True)], 0)]
    assert executor.imports == [[4, 1, 0, 3]]
    assert executor.batches[2:] == [[("r2", 16, 1)], [("r2", 17, 1)]]
    assert (r2.num_cached_tokens, engine.stats().num_external_hit_tokens) == (16, 16)
    assert r2.output_token_ids == reference_tokens(prompt, 2)


def test_preemption_in_flight_defers_the_free_and_the_request_recomputes() -> None:
    """r0 needs a third block; r1, the latest, is preempted while its decode is in flight. Block
    2 (not written in flight) goes to r0 at once; block 3 (written by r1's batch) only returns
    when that batch is back, and r1's token from it is dropped and recomputed."""
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(executor=executor, num_blocks=4, block_size=4)
    r0 = make_request(prompt_of(7), 3, request_id="r0")
    r1 = make_request(prompt_of(6, start=3), 4, request_id="r1")
    engine.add_request(r0)
    engine.add_request(r1)
    assert steps(engine, 3) == [([("r0", 1, False)], 1), ([("r1", 1, False)], 1),
                                ([("r0", 1, False)], 1)]
    assert executor.batches[3] == [("r1", 6, 1)]  # in flight: writes position 6 in block 3
    assert steps(engine, 1) == [([], 1)]  # r1 preempted; its batch came back, news dropped
    assert executor.batches[4] == [("r0", 8, 1)]
    assert engine.kv.block_ids(r0.request_id) == [0, 1, 2]
    assert (r1.status, r1.num_preemptions, r1.num_computed_tokens) == (
        RequestStatus.PREEMPTED, 1, 0)
    assert engine.kv.pool.free_queue.block_ids() == [3]
    assert steps(engine, 4) == [([("r0", 1, True)], 0), ([("r1", 1, False)], 0),
                                ([("r1", 1, False)], 0), ([("r1", 1, True)], 0)]
    assert executor.batches[5:] == [[("r1", 0, 7)], [("r1", 7, 1)], [("r1", 8, 1)]]
    assert r0.output_token_ids == reference_tokens(prompt_of(7), 3)
    assert r1.output_token_ids == reference_tokens(prompt_of(6, start=3), 4)
    assert engine.stats().num_preemptions == 1


def test_aborting_everything_in_flight_drains_the_batches() -> None:
    executor = PipelineFakeExecutor(num_stages=2)
    engine, _ = make_engine(executor=executor)
    requests = [make_request(prompt_of(n), 5) for n in (4, 6, 8)]
    for r in requests:
        engine.add_request(r)
    engine.step()
    assert engine.stats().num_batches_in_flight == 1
    for r in requests:
        engine.abort_request(r.request_id)
    assert run_to_completion(engine) == {}
    assert engine.stats().num_batches_in_flight == 0 and engine.stats().kv_usage == 0.0


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
        {"max_num_batched_tokens": 16},  # heavy chunking
        {"num_blocks": 40},  # forces preemptions, some in flight
    ],
    ids=["default", "no-prefix-cache", "no-chunking", "small-budget", "preemption"],
)
def test_batches_in_flight_give_each_request_its_solo_tokens(options: dict,
                                                             num_stages: int) -> None:
    executor = PipelineFakeExecutor(num_stages)
    engine, _ = make_engine(executor=executor, max_num_seqs=16, **options)
    requests = [make_request(prompt_of(n, start=n), max_tokens=20) for n in MIXED_LENGTHS]
    for r in requests:
        engine.add_request(r)
    got = run_to_completion(engine)
    for r, n in zip(requests, MIXED_LENGTHS, strict=True):
        assert got[r.request_id] == reference_tokens(prompt_of(n, start=n), 20), n
    assert executor.max_in_flight == num_stages
    if options.get("num_blocks") == 40:
        assert engine.stats().num_preemptions > 0


def stream(engine: Engine, requests: list) -> dict[str, tuple[str, FinishReason | None, object]]:
    """Each request's streamed text, finish reason and stop reason."""
    for r in requests:
        engine.add_request(r)
    text: dict[str, str] = {}
    ends: dict[str, tuple[FinishReason | None, object]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text[out.request_id] = text.get(out.request_id, "") + out.new_text
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.stop_reason)
        engine.check_integrity()
    return {rid: (text[rid], *ends[rid]) for rid in ends}


def test_stop_strings_seeds_and_eos_end_as_with_a_plain_executor() -> None:
    def workload() -> list:
        prompt = prompt_of(5)
        text = "".join(ALPHABET[t] for t in reference_tokens(prompt, 12))
        eos = make_request(prompt_of(9), 8, request_id="eos")
        eos.eos_token_ids = (reference_tokens(prompt_of(9), 8)[3],)
        return [
            make_request(prompt, 12, request_id="stop", stop=(text[6:9],)),
            make_request(prompt_of(6), 10, request_id="seeded", temperature=0.8, seed=42),
            make_request(prompt_of(30, start=4), 9, request_id="long"),
            eos,
        ]

    plain, _ = make_engine()
    pipelined, executor = make_engine(executor=PipelineFakeExecutor(2))
    expected = stream(plain, workload())
    assert stream(pipelined, workload()) == expected
    assert expected["stop"][1:] == (FinishReason.STOP, "".join(
        ALPHABET[t] for t in reference_tokens(prompt_of(5), 12))[6:9])
    assert expected["eos"][1] == FinishReason.STOP
    assert executor.max_in_flight == 2


def test_async_engine_serves_a_pipelined_engine() -> None:
    """AsyncEngine steps while work remains; batches in flight count as work."""
    engine, executor = make_engine(executor=PipelineFakeExecutor(2))
    async_engine = AsyncEngine(engine, max_model_len=256)
    async_engine.start()
    prompts = [prompt_of(5), prompt_of(9, start=3), prompt_of(3, start=7)]

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in async_engine.generate(make_request(prompt, 6)):
            tokens += out.new_token_ids
        return tokens

    async def story() -> list[list[int]]:
        results = await asyncio.gather(*(one(p) for p in prompts))
        await async_engine.shutdown(timeout_s=5)
        return list(results)

    assert asyncio.run(story()) == [reference_tokens(p, 6) for p in prompts]
    assert engine.stats().num_batches_in_flight == 0
    engine.check_integrity()
