"""Pipeline parallel with batches in flight: while stage 1 runs one batch, stage 0 runs the next.

Float32 greedy tokens stay identical to one process (and logprobs within 1e-4) with two batches
in flight, under heavy chunking and preemption too (batch invariance); the stages' busy time and
rank 0's communication are counted; a KV export drains the pipeline first; and stages that name
two hosts talk through gloo between stages and shared memory inside each, as across machines,
and fail within 5 s when one host goes silent (liveness.py).
"""

from __future__ import annotations

import os
import signal
import time
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

from strata.engine.engine import Engine
from strata.engine.executor import AsyncModelExecutor, ModelInput, ScheduledSequence
from strata.engine.request import Request, SamplingParams
from strata.errors import RankFailedError
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.parallel.comm import Host
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.launcher import MpRankLauncher
from strata.model.parallel.shard_loader import PreparedModel
from strata.model.parallel.shm import SHM_DIR
from strata.model.parallel.worker import EXIT_RANK_FAILED
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


def test_stages_on_two_hosts_talk_through_gloo_and_a_frozen_host_fails_within_5_s(
        prepared: PreparedModel, reference: list[Greedy]) -> None:
    """T=2 x P=2 with stage 1 on "another host" (the same machine under another host id): the
    world group is gloo, each stage's tp group shared memory (stage 1's segment made by rank 2),
    and the tokens do not change. Then rank 2 is frozen mid-step (SIGSTOP: silent, its sockets
    open, as when its node is lost), which gloo alone would wait out for a day: the heartbeats
    fail rank 0's step within 5 s, naming rank 2, and rank 3 on the frozen rank's host leaves
    by itself (exit code 3: rank 0 cut it off)."""
    hosts = [Host("a", "127.0.0.1")] * 2 + [Host("b", "127.0.0.1")] * 2
    executor = parallel_executor(prepared, 2, 2, launcher=MpRankLauncher(hosts=hosts))
    in_flight: list[int] = []
    pids = executor.launcher.pids()
    try:
        spec = executor.comm_spec
        assert (spec.world_backend, spec.tp_backend) == ("gloo", "shm")
        assert spec.init_method is not None and spec.init_method.startswith("tcp://127.0.0.1:")
        engine = make_engine(executor, prepared.config.vocab_size)
        got = run_greedy(engine, prompts(), in_flight=in_flight)
        failed, elapsed = _freeze_mid_step(engine, pids[2])
    finally:
        os.kill(pids[2], signal.SIGKILL)
        executor.shutdown(timeout_s=5.0)
    assert_same(got, reference)
    assert max(in_flight) == 1
    assert not list(SHM_DIR.glob(f"{spec.prefix}-*")), "every segment was unlinked"
    assert failed.rank == 2 and "rank 2 sent no heartbeat" in str(failed), failed
    assert elapsed < 5.0
    stage_1_peer = executor.launcher._procs[3]  # type: ignore[attr-defined]
    assert stage_1_peer.exitcode == EXIT_RANK_FAILED


def _freeze_mid_step(engine: Engine, pid: int) -> tuple[RankFailedError, float]:
    """SIGSTOP `pid` after a few steps of a long request; the error of the engine's step and
    how long after the freeze it came."""
    params = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(RequestId("frozen"), prompts()[0], params, arrival_time=0.0))
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failed:
        while engine.has_unfinished_requests():
            engine.step()
    return failed.value, time.monotonic() - start
