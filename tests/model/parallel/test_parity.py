"""A parallel instance computes what one process computes: float32 greedy tokens identical to
T = P = 1 and logprobs within 1e-4, for T=2 (uneven heads: 5 + 4 around a shared KV head),
T=3, P=2 and T=2 x P=2; and batch invariance inside a T=2 instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model.parallel.parallel_helpers import (
    Greedy,
    assert_same,
    make_engine,
    parallel_executor,
    prompts,
    run_greedy,
)
from model.parallel.warm_ranks import WarmRankPool

from strata.engine.executor import ModelInput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.shard_loader import PreparedModel
from strata.types import RequestId


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Rank 0 (this process) on one thread, as every other rank (`threads=1`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pool() -> Iterator[WarmRankPool]:
    """Rank processes for every layout here (T=2's one, alive throughout, and the most any
    other layout needs: 3), each importing torch once."""
    warm = WarmRankPool(4)
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def tp2(prepared: PreparedModel, pool: WarmRankPool) -> Iterator[ParallelExecutor]:
    executor = parallel_executor(prepared, 2, launcher=pool.launcher())
    yield executor
    executor.shutdown()


def test_t2_matches_one_process(tp2: ParallelExecutor, prepared: PreparedModel,
                                reference: list[Greedy]) -> None:
    got = run_greedy(make_engine(tp2, prepared.config.vocab_size), prompts())
    assert_same(got, reference)
    assert len({tuple(r.tokens) for r in reference}) > 8  # the outputs are not degenerate


def test_batch_invariance_inside_a_t2_instance(tp2: ParallelExecutor, prepared: PreparedModel,
                                               reference: list[Greedy]) -> None:
    """Alone, or in a batch with heavy chunking and preemption: the same tokens."""
    engine = make_engine(tp2, prepared.config.vocab_size, num_blocks=60, budget=24)
    batched = run_greedy(engine, prompts(), first_id=100)
    alone = [run_greedy(engine, [p], first_id=200 + i)[0] for i, p in enumerate(prompts()[:4])]
    assert [b.tokens for b in batched] == [r.tokens for r in reference]
    assert [a.tokens for a in alone] == [r.tokens for r in reference[:4]]
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize(("tensor", "pipeline"), [(3, 1), (1, 2), (2, 2)],
                         ids=["tp3", "pp2", "tp2xpp2"])
def test_other_layouts_match_one_process(prepared: PreparedModel, reference: list[Greedy],
                                         pool: WarmRankPool, tensor: int,
                                         pipeline: int) -> None:
    """With two stages the engine keeps two batches in flight: after a step collects one,
    the other is still out."""
    executor = parallel_executor(prepared, tensor, pipeline, launcher=pool.launcher())
    in_flight: list[int] = []
    try:
        got = run_greedy(make_engine(executor, prepared.config.vocab_size), prompts(),
                         in_flight=in_flight)
    finally:
        executor.shutdown()
    assert_same(got, reference)
    assert max(in_flight) == pipeline - 1


def test_each_rank_holds_its_share_of_weights_and_kv(tp2: ParallelExecutor,
                                                     prepared: PreparedModel) -> None:
    memory = tp2.rank_memory()
    c = prepared.config
    whole = sum(w.numel() * 4 for w in load_model(prepared.source, dtype="float32")
                .weights.values())
    assert [m.rank for m in memory] == [0, 1]
    assert all(m.weight_bytes < 0.6 * whole for m in memory)
    # Two of the three KV heads each, every layer, float32, over the allocated slots.
    per_token = 2 * 2 * c.head_dim * 4 * c.num_hidden_layers
    assert tp2.kv_bytes_per_token() == per_token
    assert memory[0].kv_bytes == memory[1].kv_bytes > 0
    assert memory[0].kv_bytes % per_token == 0


def test_kv_blocks_travel_in_the_whole_models_layout(tp2: ParallelExecutor, model_dir: Path,
                                                     prepared: PreparedModel) -> None:
    """A T=2 export holds what a one-process export holds; a one-process export imports into
    T=2 and comes back out byte for byte."""
    loaded = load_model(model_dir, dtype="float32")
    single = TorchExecutor(loaded.config, loaded.weights, dtype="float32")
    single.allocate_kv_cache(256, 4)
    make_engine(tp2, prepared.config.vocab_size)  # allocates 256 blocks of 4 on every rank
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tokens = prompts()[4][:16]  # four full blocks
    step = ModelInput([ScheduledSequence(RequestId("kv"), tokens, 0, [7, 8, 9, 10], True, params,
                                         [], tokens)], block_size=4)
    assert tp2.execute(step).keys() == single.execute(step).keys()  # fills blocks 7 .. 10
    ours, theirs = tp2.export_blocks([7, 8, 9, 10]), single.export_blocks([7, 8, 9, 10])
    codec = single.kv_codec
    assert codec is not None and len(ours) == 4
    for a, b in zip(ours, theirs, strict=True):
        got = torch.frombuffer(bytearray(codec.decode(a)), dtype=torch.float32)
        want = torch.frombuffer(bytearray(codec.decode(b)), dtype=torch.float32)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tp2.import_blocks([20, 21, 22, 23], theirs) == 4
    assert tp2.export_blocks([20, 21, 22, 23]) == theirs
    damaged = theirs[1][:-1] + bytes([theirs[1][-1] ^ 1])
    assert tp2.import_blocks([30, 31], [theirs[0], damaged]) == 1
