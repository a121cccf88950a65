"""LoRA adapters on a parallel instance compute what one process computes with them (float32).

The nine-head tiny model (T=2 splits its heads 5 + 4 around a shared KV head, so both ranks
hold KV head 1 and its adapter rows) with two PEFT adapters (A: all seven modules, r=4; B: q,
v, down, r=8, rsLoRA): the 16 prompts of the parallel tests on the base, A and B by turns, in
one batch. T=2 and P=2 give T=1's greedy tokens, logprobs within 1e-4 (bf16, the default dtype:
test_lora_parallel_bf16.py). An adapter removed from a T=2 executor is gone on both ranks: a
step that still names it fails on each, and the executor goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bf16_rule import Run
from lora.parallel_lora import ADAPTERS, adapters, one_process, parallel, run_parallel

from strata.engine.executor import ModelInput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.errors import ShareFailedError
from strata.model.parallel.executor import ParallelExecutor
from strata.types import RequestId

pytestmark = pytest.mark.needs("shm")


@pytest.fixture(scope="module")
def reference(nine_head_loras: dict[str, Path]) -> list[Run]:
    got = one_process(nine_head_loras, "float32")
    base, *others = [{tuple(r.tokens) for r in got[i::3]} for i in range(len(ADAPTERS))]
    assert all(not base & o for o in others)  # each adapter changes every answer
    return got


@pytest.fixture(scope="module")
def tp2(nine_head_loras: dict[str, Path]) -> Iterator[ParallelExecutor]:
    executor = parallel(nine_head_loras, 2, 1, "float32")
    yield executor
    executor.shutdown()


def assert_same(got: list[Run], want: list[Run]) -> None:
    """Identical tokens, logprobs within 1e-4."""
    assert [g.tokens for g in got] == [w.tokens for w in want]
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4


def test_t2_with_adapters_is_identical_to_t1(tp2: ParallelExecutor,
                                             nine_head_loras: dict[str, Path],
                                             reference: list[Run]) -> None:
    assert_same(run_parallel(tp2, nine_head_loras), reference)


def test_p2_with_adapters_is_identical_to_t1(nine_head_loras: dict[str, Path],
                                             reference: list[Run]) -> None:
    executor = parallel(nine_head_loras, 1, 2, "float32")
    try:
        assert_same(run_parallel(executor, nine_head_loras), reference)
    finally:
        executor.shutdown()


def test_a_removed_adapter_is_gone_on_every_rank(tp2: ParallelExecutor,
                                                 nine_head_loras: dict[str, Path]) -> None:
    (a, _) = adapters(nine_head_loras, tp2.config)
    digest = tp2.add_lora(a)
    tp2.allocate_kv_cache(16, 4)
    seq = ScheduledSequence(RequestId("x"), [5, 6, 7], 0, [0], True,
                            SamplingParams(temperature=0.0), [], [5, 6, 7],
                            lora_name="a", lora_digest=digest)
    assert len(tp2.execute(ModelInput([seq], 4))) == 1
    tp2.remove_lora(digest)
    assert not tp2.has_lora(digest)
    with pytest.raises(ShareFailedError, match="lora_loaded") as failed:
        tp2.execute(ModelInput([seq], 4))
    assert failed.value.ranks == (0, 1)  # each rank found it gone
    assert tp2.is_alive()
    assert tp2.add_lora(a) == digest and len(tp2.execute(ModelInput([seq], 4))) == 1
