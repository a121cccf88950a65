"""AsyncEngine with the fake executor: outputs, abort on close, the engine's death, and reads of
held blocks by the engine thread."""

from __future__ import annotations

import asyncio
import threading
import time
from array import array

import pytest
from engine_fakes import (
    KV_TAG,
    KVFakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
)
from harness.procs import wait_until

from strata.engine.executor import ModelInput, ModelOutput
from strata.engine.request import Request
from strata.errors import EngineDeadError, InvalidRequestError
from strata.server.async_engine import AsyncEngine


def test_generate_streams_the_reference_tokens_then_stops() -> None:
    engine, _ = make_engine()
    async_engine = AsyncEngine(engine, max_model_len=256)
    async_engine.start()

    async def story() -> list[int]:
        tokens: list[int] = []
        async for out in async_engine.generate(make_request(prompt_of(5), 6, ignore_eos=True)):
            tokens += out.new_token_ids
        await async_engine.shutdown(timeout_s=5)
        return tokens

    assert asyncio.run(story()) == reference_tokens(prompt_of(5), 6)
    assert not async_engine.is_healthy  # shut down


def test_validation_errors_raise_in_the_caller_before_queueing() -> None:
    engine, _ = make_engine(max_model_len=16)
    async_engine = AsyncEngine(engine, max_model_len=16)
    async_engine.start()
    with pytest.raises(InvalidRequestError, match="16"):
        async_engine.generate(make_request(prompt_of(20), 2))
    assert async_engine.num_in_flight == 0
    asyncio.run(async_engine.shutdown(timeout_s=1))


def test_refusal_in_the_engine_thread_raises_at_first_iteration() -> None:
    engine, executor = make_engine(max_waiting=1, max_num_seqs=1)
    entered, release = threading.Event(), threading.Event()
    real_execute = executor.execute

    def execute(model_input: ModelInput) -> ModelOutput:
        entered.set()
        release.wait()
        return real_execute(model_input)

    executor.execute = execute  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, max_model_len=256)
    async_engine.start()

    async def story() -> list[str]:
        gens = [async_engine.generate(make_request(prompt_of(4), 3)) for _ in range(3)]
        first = asyncio.ensure_future(anext(gens[0]))
        await asyncio.to_thread(entered.wait)  # the first request runs, the engine is stuck
        others = [asyncio.ensure_future(anext(g)) for g in gens[1:]]
        while async_engine.num_in_flight < 3:
            await asyncio.sleep(0.01)
        release.set()  # the second waits (max_waiting=1); the third is refused
        results = await asyncio.gather(first, *others, return_exceptions=True)
        for g in gens:
            await g.aclose()
        await async_engine.shutdown(timeout_s=5)
        return [type(r).__name__ for r in results]

    assert asyncio.run(story()) == ["RequestOutput", "RequestOutput", "OverloadedError"]


def test_closing_the_stream_aborts_the_request_and_frees_its_blocks() -> None:
    engine, executor = make_engine()
    second_step, release = threading.Event(), threading.Event()
    real_execute = executor.execute

    def execute(model_input: ModelInput) -> ModelOutput:
        if executor.num_steps >= 1:  # hold the second step until the stream is closed
            second_step.set()
            release.wait()
        return real_execute(model_input)

    executor.execute = execute  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, max_model_len=256)
    async_engine.start()

    async def story() -> None:
        gen = async_engine.generate(make_request(prompt_of(9), 200, ignore_eos=True))
        await anext(gen)
        await asyncio.to_thread(second_step.wait)
        await gen.aclose()
        release.set()
        while async_engine.stats().num_running or async_engine.stats().num_waiting:
            await asyncio.sleep(0.01)
        await async_engine.shutdown(timeout_s=5)

    asyncio.run(story())
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_generated_tokens == 2  # the abort landed right after the held step
    engine.check_integrity()


class Boom(RuntimeError):
    pass


def test_a_failing_step_ends_every_request_with_error_and_kills_the_engine() -> None:
    engine, executor = make_engine()
    calls = {"n": 0}
    real_execute = executor.execute

    def execute(model_input: ModelInput) -> ModelOutput:
        calls["n"] += 1
        if calls["n"] >= 3:  # from then on: one failing step of one request is survived
            raise Boom("the GPU fell off")
        return real_execute(model_input)

    executor.execute = execute  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, max_model_len=256)
    deaths: list[str] = []
    async_engine.on_death(deaths.append)
    async_engine.start()

    tokens: dict[int, list[int]] = {3: [], 4: []}

    async def story() -> list[str | None]:
        async def run(n: int) -> str | None:
            reason = None
            async for out in async_engine.generate(make_request(prompt_of(n), 50, ignore_eos=True)):
                reason = out.finish_reason.value if out.finish_reason else None
                tokens[n] += out.new_token_ids
            return reason

        return list(await asyncio.gather(run(3), run(4)))

    assert asyncio.run(story()) == ["error", "error"]
    assert not async_engine.is_healthy
    assert async_engine.dead_reason == "Boom: the GPU fell off"
    with pytest.raises(EngineDeadError, match="GPU fell off"):
        async_engine.generate(make_request(prompt_of(3), 2))
    for n, streamed in tokens.items():  # what streamed before the failure was right, and short
        assert streamed == reference_tokens(prompt_of(n), 50)[:len(streamed)] and \
            len(streamed) < 50
    # the hook `strata serve` exits by runs on the engine thread right after the streams ended
    wait_until(lambda: bool(deaths), 5, "the death hook")
    assert deaths == ["Boom: the GPU fell off"]


def test_a_request_the_executor_cannot_run_fails_alone_and_the_engine_lives() -> None:
    engine, executor = make_engine()
    real_execute = executor.execute

    def execute(model_input: ModelInput) -> ModelOutput:
        if any(s.request_id == "poison" for s in model_input.sequences):
            raise Boom("cannot run poison")
        return real_execute(model_input)

    executor.execute = execute  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, max_model_len=256)
    deaths: list[str] = []
    async_engine.on_death(deaths.append)
    async_engine.start()

    async def run(request_id: str | None) -> tuple[str | None, list[int]]:
        reason, tokens = None, []
        request = make_request(prompt_of(5), 12, request_id=request_id)
        async for out in async_engine.generate(request):
            reason = out.finish_reason.value if out.finish_reason else None
            tokens += out.new_token_ids
        return reason, tokens

    async def story() -> list[tuple[str | None, list[int]]]:
        results = list(await asyncio.gather(run("poison"), run(None), run(None)))
        await async_engine.shutdown(timeout_s=5)
        return results

    assert asyncio.run(story()) == [("error", []),
                                    ("length", reference_tokens(prompt_of(5), 12)),
                                    ("length", reference_tokens(prompt_of(5), 12))]
    assert deaths == [] and async_engine.dead_reason is None


class OneDriverExecutor(KVFakeExecutor):
    """Records which thread runs each step and each export, and whether an export ever ran
    while a step was running (a parallel executor's ranks would then get two commands at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.is_stepping = False
        self.num_overlaps = 0

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.threads.add(threading.current_thread().name)
        self.is_stepping = True
        try:
            time.sleep(0.002)  # a step long enough for a read from elsewhere to land in it
            return super().execute(model_input)
        finally:
            self.is_stepping = False

    def export_blocks(self, block_ids: list[int]) -> list[bytes]:
        self.threads.add(threading.current_thread().name)
        self.num_overlaps += self.is_stepping
        return super().export_blocks(block_ids)


def test_held_blocks_are_read_by_the_engine_thread_between_steps() -> None:
    executor = OneDriverExecutor()
    engine, _ = make_engine(executor=executor)
    async_engine = AsyncEngine(engine, max_model_len=256)
    async_engine.start()
    held = make_request(prompt_of(12), 1)  # 3 full blocks (the fake exports no partial one)
    held.hold_blocks = True

    async def story() -> tuple[list[list[bytes]], list[bytes], list[int]]:
        block_ids: list[int] = []
        async for out in async_engine.generate(held):
            block_ids = list(out.held.block_ids) if out.held else block_ids
        busy = asyncio.ensure_future(_drain(async_engine, make_request(prompt_of(9), 40,
                                                                      ignore_eos=True)))
        reads = await asyncio.gather(*[async_engine.export_held(held.request_id, block_ids)
                                       for _ in range(20)])
        async_engine.release_held(held.request_id)
        after_release = await async_engine.export_held(held.request_id, block_ids)
        tokens = await busy
        await async_engine.shutdown(timeout_s=5)
        return reads, after_release, tokens

    reads, after_release, tokens = asyncio.run(story())
    assert len(reads[0]) == 3 and all(r == reads[0] for r in reads)
    assert reads[0][0] == KV_TAG + array("q", prompt_of(12)[:4]).tobytes()
    assert after_release == []  # the hold is gone: nothing is read from reused blocks
    assert tokens == reference_tokens(prompt_of(9), 40)
    assert executor.threads == {"strata-engine"} and executor.num_overlaps == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(async_engine.export_held(held.request_id, [0]))


def test_a_read_that_breaks_the_executor_is_fatal_and_answered() -> None:
    executor = KVFakeExecutor()
    engine, _ = make_engine(executor=executor)

    def broken(block_ids: list[int]) -> list[bytes]:
        raise Boom("the cache is gone")

    executor.export_blocks = broken  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, max_model_len=256)
    deaths: list[str] = []
    async_engine.on_death(deaths.append)
    async_engine.start()
    held = make_request(prompt_of(6), 1)
    held.hold_blocks = True

    async def story() -> None:
        async for out in async_engine.generate(held):
            assert out.held is not None
            block_ids = list(out.held.block_ids)
        with pytest.raises(EngineDeadError, match="the cache is gone"):
            await async_engine.export_held(held.request_id, block_ids)

    asyncio.run(story())
    wait_until(lambda: bool(deaths), 5, "the death hook")
    assert deaths == ["Boom: the cache is gone"] and not async_engine.is_healthy


async def _drain(async_engine: AsyncEngine, request: Request) -> list[int]:
    tokens: list[int] = []
    async for out in async_engine.generate(request):
        tokens += out.new_token_ids
    return tokens
