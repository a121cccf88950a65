"""One request never kills the engine: a sequence that breaks the executor fails alone
(finish_reason "error", its blocks freed); an executor that can run nothing is fatal."""

from __future__ import annotations

import pytest
from engine_fakes import (
    FakeExecutor,
    make_engine,
    make_request,
    prompt_of,
    reference_tokens,
    run_to_completion,
)

from strata.engine.executor import ModelInput, ModelOutput
from strata.engine.isolation import execute_isolated
from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason
from strata.errors import RankFailedError
from strata.types import RequestId


class PoisonExecutor(FakeExecutor):
    """Raises whenever a batch holds `poison` once it has generated `after_tokens` tokens."""

    def __init__(self, poison: str, after_tokens: int = 0) -> None:
        super().__init__()
        self.poison = poison
        self.after_tokens = after_tokens
        self.num_raised = 0

    def execute(self, model_input: ModelInput) -> ModelOutput:
        for seq in model_input.sequences:
            if seq.request_id == self.poison and len(seq.output_token_ids) >= self.after_tokens:
                self.num_raised += 1
                raise ValueError(f"cannot run {seq.request_id}")
        return super().execute(model_input)


class BrokenExecutor(FakeExecutor):
    """Every step fails (a lost device)."""

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.num_steps += 1
        raise RuntimeError("device lost")


def run_collecting(engine: object) -> dict[RequestId, list[RequestOutput]]:
    outputs: dict[RequestId, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():  # type: ignore[attr-defined]
            return outputs
        for out in engine.step():  # type: ignore[attr-defined]
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()  # type: ignore[attr-defined]
    raise AssertionError("engine did not finish")


def test_a_poisoned_request_fails_alone_and_the_batch_gets_its_solo_tokens() -> None:
    engine, executor = make_engine(executor=PoisonExecutor("poison"))
    requests = [make_request(prompt_of(n, start=n), max_tokens=10) for n in (5, 9, 13, 3, 21)]
    poison = make_request(prompt_of(7), max_tokens=10, request_id="poison")
    for r in [*requests[:2], poison, *requests[2:]]:
        engine.add_request(r)
    outputs = run_collecting(engine)
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outputs[poison.request_id]] \
        == [(True, FinishReason.ERROR, [])]
    for r, n in zip(requests, (5, 9, 13, 3, 21), strict=True):
        tokens = [t for o in outputs[r.request_id] for t in o.new_token_ids]
        assert tokens == reference_tokens(prompt_of(n, start=n), 10)
        assert r.finish_reason == FinishReason.LENGTH
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaked
    assert engine._batches._executor.runner.num_failed_requests == 1  # type: ignore[attr-defined]


def test_a_request_that_breaks_mid_decode_keeps_its_tokens_and_ends_with_error() -> None:
    engine, executor = make_engine(executor=PoisonExecutor("poison", after_tokens=3))
    other = make_request(prompt_of(11), max_tokens=8)
    poison = make_request(prompt_of(6), max_tokens=8, request_id="poison")
    engine.add_request(other)
    engine.add_request(poison)
    outputs = run_collecting(engine)
    poison_tokens = [t for o in outputs[poison.request_id] for t in o.new_token_ids]
    assert poison_tokens == reference_tokens(prompt_of(6), 3)
    assert outputs[poison.request_id][-1].finish_reason == FinishReason.ERROR
    assert [t for o in outputs[other.request_id] for t in o.new_token_ids] \
        == reference_tokens(prompt_of(11), 8)
    # the engine goes on: a new request after the failure runs as if nothing happened
    late = make_request(prompt_of(4), max_tokens=5)
    engine.add_request(late)
    assert run_to_completion(engine)[late.request_id] == reference_tokens(prompt_of(4), 5)


def test_bisection_finds_each_failing_sequence_with_few_executions() -> None:
    executor = PoisonExecutor("r5")
    engine, _ = make_engine(executor=executor, max_num_seqs=16)
    requests = [make_request(prompt_of(3, start=i), max_tokens=1, request_id=f"r{i}")
                for i in range(16)]
    for r in requests:
        engine.add_request(r)
    before = executor.num_steps
    outputs = engine.step()
    assert {o.request_id: o.finish_reason for o in outputs if o.request_id == "r5"} \
        == {"r5": FinishReason.ERROR}
    assert sum(o.finish_reason == FinishReason.LENGTH for o in outputs) == 15
    # 16 -> 8 -> 4 -> 2 -> 1: one failing execution per level, the good halves run once
    assert executor.num_raised == 5
    assert executor.num_steps - before == 4  # the good halves of 8, 4, 2 and 1 run once each


def test_an_executor_that_fails_every_batch_is_fatal_at_once() -> None:
    engine, executor = make_engine(executor=BrokenExecutor())
    for n in (4, 6):
        engine.add_request(make_request(prompt_of(n), max_tokens=4))
    with pytest.raises(RuntimeError, match="device lost") as failure:
        engine.step()
    assert failure.value.__notes__ == [
        "no sequence of a batch of 2 could run: the executor is at fault, not a request"]


class DeadRankExecutor(FakeExecutor):
    """A rank died: the executor cannot go on, whatever the batch."""

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.num_steps += 1
        raise RankFailedError("rank 1 died", rank=1)


def test_a_dead_rank_is_fatal_without_a_retry() -> None:
    engine, executor = make_engine(executor=DeadRankExecutor())
    for n in (4, 6, 8):
        engine.add_request(make_request(prompt_of(n), max_tokens=4))
    with pytest.raises(RankFailedError, match="rank 1 died"):
        engine.step()
    assert executor.num_steps == 1  # no half was run again


def test_a_lone_failure_fails_its_request_and_a_second_in_a_row_is_fatal() -> None:
    engine, executor = make_engine(executor=BrokenExecutor())
    first = make_request(prompt_of(4), max_tokens=4)
    engine.add_request(first)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] \
        == [(first.request_id, FinishReason.ERROR)]
    engine.add_request(make_request(prompt_of(5), max_tokens=4))
    with pytest.raises(RuntimeError, match="device lost") as failure:
        engine.step()
    assert "(the second failed batch in a row)" in failure.value.__notes__[0]


def test_execute_isolated_returns_the_whole_output_when_nothing_fails() -> None:
    engine, executor = make_engine()
    engine.add_request(make_request(prompt_of(4), max_tokens=1, request_id="a"))
    model_input = engine._model_input(engine.scheduler.schedule())
    result = execute_isolated(executor.execute, model_input)
    assert list(result.output) == ["a"] and result.failed == {}
