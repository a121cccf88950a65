"""Pipeline parallel with batches in flight: while stage 1 runs one batch, stage 0 runs the next.

Float32 greedy tokens stay identical to one process (and logprobs within 1e-4) with two batches
in flight, under heavy chunking and preemption too (batch invariance); the stages' busy time and
rank 0's communication are counted; a KV export drains the pipeline first; and stages that name
two hosts talk through gloo between stages and shared memory inside each, as across machines.
"""

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

from strata.engine.executor import AsyncModelExecutor, ModelInput, ScheduledSequence
from strata.engine.request import SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.parallel.comm import Host
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.launcher import MpRankLauncher
from strata.model.parallel.shard_loader import PreparedModel
from strata.model.parallel.shm import SHM_DIR
from strata.types import RequestId

pytestmark = pytest.mark.needs("shm")


@pytest.fixture(scope="module")
def pp2(prepared: PreparedModel) -> Iterator[ParallelExecutor]:
    executor = parallel_executor(prepared, 1, 2)
    yield executor
    executor.shutdown()


def test_two_stages_keep_two_batches_in_flight(pp2: ParallelExecutor) -> None:
    assert isinstance(pp2, AsyncModelExecutor)
    assert pp2.max_concurrent_batches == 2
    assert pp2.comm_spec.world_backend == pp2.comm_spec.tp_backend == "shm"


def test_batch_invariance_with_batches_in_flight(pp2: ParallelExecutor, prepared: PreparedModel,
                                                 reference: list[Greedy]) -> None:
    """Alone, or in batches split two ways with heavy chunking and preemption: the same
    tokens and logprobs."""
    engine = make_engine(pp2, prepared.config.vocab_size, num_blocks=60, budget=24)
    in_flight: list[int] = []
    batched = run_greedy(engine, prompts(), first_id=100, in_flight=in_flight)
    alone = [run_greedy(engine, [p], first_id=200 + i)[0] for i, p in enumerate(prompts()[:4])]
    assert_same(batched, reference)
    assert_same(alone, reference[:4])
    assert engine.stats().num_preemptions > 0
    assert max(in_flight) == 1


def test_stage_busy_time_and_communication_are_counted(pp2: ParallelExecutor,
                                                        prepared: PreparedModel) -> None:
    before = pp2.pipeline_stats()
    run_greedy(make_engine(pp2, prepared.config.vocab_size), prompts()[:6], first_id=300)
    after = pp2.pipeline_stats()
    assert after.num_steps > before.num_steps
    assert after.active_s > before.active_s
    assert all(a > b for a, b in zip(after.stage_busy_s, before.stage_busy_s, strict=True))
    fractions = after.busy_fractions(before)
    assert len(fractions) == 2 and all(0 < f <= 1 for f in fractions)
    assert after.comm_s >= before.comm_s >= 0
    assert after.comm_s_per_step(before) >= 0
    assert after.busy_fractions(after) == (0.0, 0.0)  # no time passed: idle, not undefined


def test_a_kv_export_drains_the_batches_in_flight(pp2: ParallelExecutor, model_dir: Path,
                                                  prepared: PreparedModel) -> None:
    """Two batches out, then an export of the first's blocks: the blocks are those one process
    writes, and both batches still return their tokens afterwards."""
    loaded = load_model(model_dir, dtype="float32")
    single = TorchExecutor(loaded.config, loaded.weights, dtype="float32")
    single.allocate_kv_cache(256, 4)
    make_engine(pp2, prepared.config.vocab_size)  # allocates 256 blocks of 4 on every rank
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def step(rid: str, tokens: list[int], blocks: list[int]) -> ModelInput:
        return ModelInput([ScheduledSequence(RequestId(rid), tokens, 0, blocks, True, params,
                                             [], tokens)], block_size=4)

    first = step("a", prompts()[4][:16], [7, 8, 9, 10])
    second = step("b", prompts()[2][:8], [11, 12])
    want = [single.execute(first), single.execute(second)]
    handles = [pp2.submit(first), pp2.submit(second)]
    ours, theirs = pp2.export_blocks([7, 8, 9, 10]), single.export_blocks([7, 8, 9, 10])
    codec = single.kv_codec
    assert codec is not None
    for a, b in zip(ours, theirs, strict=True):
        got = torch.frombuffer(bytearray(codec.decode(a)), dtype=torch.float32)
        torch.testing.assert_close(
            got, torch.frombuffer(bytearray(codec.decode(b)), dtype=torch.float32),
            atol=1e-5, rtol=1e-5)
    assert [pp2.collect(h) for h in handles] == want


def test_stages_on_two_hosts_talk_through_gloo_between_and_shm_within(
        prepared: PreparedModel, reference: list[Greedy]) -> None:
    """T=2 x P=2 with stage 1 on "another host" (the same machine under another host id): the
    world group is gloo, each stage's tp group shared memory (stage 1's segment made by rank 2),
    and the tokens do not change."""
    hosts = [Host("a", "127.0.0.1")] * 2 + [Host("b", "127.0.0.1")] * 2
    executor = parallel_executor(prepared, 2, 2, launcher=MpRankLauncher(hosts=hosts))
    in_flight: list[int] = []
    try:
        spec = executor.comm_spec
        assert (spec.world_backend, spec.tp_backend) == ("gloo", "shm")
        assert spec.init_method is not None and spec.init_method.startswith("tcp://127.0.0.1:")
        got = run_greedy(make_engine(executor, prepared.config.vocab_size), prompts(),
                         in_flight=in_flight)
    finally:
        executor.shutdown()
    assert_same(got, reference)
    assert max(in_flight) == 1
    assert not list(SHM_DIR.glob(f"{spec.prefix}-*")), "every segment was unlinked"
