"""`--distributed-executor ray` on a real local Ray: the ranks of one instance are Ray actors in
one placement group (STRICT_PACK for tensor parallel, PACK with pipeline stages), they compute
what one process computes, and a rank SIGKILLed mid-step fails the executor within 2 s."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import ray
import ray_cluster
from model.parallel.parallel_helpers import (
    Greedy,
    assert_same,
    make_engine,
    prompts,
    run_greedy,
)

from strata.cluster.ray_placement import gpus_per_rank, rank_bundles, strategy_of
from strata.cluster.ray_ranks import RayPlacement, RayRankLauncher
from strata.engine.request import Request, SamplingParams
from strata.errors import RankFailedError
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import PreparedModel
from strata.types import RequestId


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with ray_cluster.local_ray(num_cpus=2):
        yield


def ray_executor(prepared: PreparedModel, tensor: int, pipeline: int = 1,
                 cpus_per_rank: float = 0.25) -> ParallelExecutor:
    launcher = RayRankLauncher(RayPlacement(cpus_per_rank=cpus_per_rank))
    return ParallelExecutor(prepared, ParallelLayout(tensor, pipeline), dtype="float32",
                            timeout_s=60, launcher=launcher)


def group_rows() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]


def test_bundles_and_strategies() -> None:
    assert strategy_of(1) == "STRICT_PACK" and strategy_of(2) == "PACK"
    assert rank_bundles(2, 0.25, "10.0.0.7") == [{"CPU": 0.25, "node:10.0.0.7": 0.001},
                                                 {"CPU": 0.25}]
    assert rank_bundles(2, 1, gpus_per_rank=1) == [{"CPU": 1, "GPU": 1}] * 2  # CUDA ranks
    assert [gpus_per_rank(argv) for argv in (["--device", "cuda"], ["--device=cuda:1"],
                                             ["--device", "cpu"], ["serve", "m"])] == [1, 1, 0, 0]


@pytest.mark.parametrize(("tensor", "pipeline", "strategy"),
                         [(2, 1, "STRICT_PACK"), (1, 2, "PACK")], ids=["tp2", "pp2"])
def test_ray_ranks_compute_what_one_process_computes(
        local_ray: None, prepared: PreparedModel, reference: list[Greedy], tensor: int,
        pipeline: int, strategy: str) -> None:
    executor = ray_executor(prepared, tensor, pipeline)
    try:
        (group,) = group_rows()
        assert group["strategy"] == strategy
        assert [b["CPU"] for b in group["bundles"].values()] == [0.25, 0.25]
        spec = executor.comm_spec  # one node: shared memory, as with local processes
        assert (spec.world_backend, spec.tp_backend) == ("shm", "shm")
        assert executor.reports[1].pid != os.getpid()
        got = run_greedy(make_engine(executor, prepared.config.vocab_size), prompts())
    finally:
        executor.shutdown()
    assert_same(got, reference)
    assert group_rows() == [], "the group went with the instance"


def test_a_rank_actor_killed_mid_step_fails_the_executor_within_2_s(
        local_ray: None, prepared: PreparedModel) -> None:
    executor = ray_executor(prepared, 2)
    failures: list[tuple[RankFailedError, float]] = []
    executor.on_failure = lambda exc: failures.append((exc, time.monotonic()))
    engine = make_engine(executor, prepared.config.vocab_size)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    errors: list[tuple[BaseException, float]] = []
    first_step = threading.Event()

    def loop() -> None:
        """Steps for ever, a new request whenever the last one finished."""
        try:
            for i in range(1_000_000):
                if not engine.has_unfinished_requests():
                    engine.add_request(Request(RequestId(f"r{i}"), prompts()[0], params,
                                               arrival_time=float(i)))
                engine.step()
                first_step.set()
        except RankFailedError as exc:
            errors.append((exc, time.monotonic()))

    stepping = threading.Thread(target=loop)
    stepping.start()
    try:
        assert first_step.wait(60)
        os.kill(executor.reports[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        stepping.join(10)
        assert errors, "the engine kept stepping"
        exc, seen_at = errors[0]
        assert exc.rank == 1 and seen_at - killed_at < 2.0
    finally:
        executor.shutdown()
        stepping.join(10)
    assert not executor.is_alive()
