"""The chaos suite: real processes (`strata up`, `strata serve`, `strata gateway`, redis-server),
closed-loop multi-turn and streaming load (tests/harness/chaos_load.py), one fault each
(tests/harness/fault_scenarios.py), every test bounded well under a minute. The long versions,
and the figures in docs/reliability.md, come from bench/chaos.py.

Each test checks what the fault may cost: no acknowledged session turn is ever lost; where the
system can hide the fault (a frozen instance, a registry outage) no request fails, and under
latency and resets between gateway and instances no stream fails; where it cannot (the
session store or the gateway itself down), requests fail only while the fault lasts.

Each also checks that the fault hit (the frozen instance was running requests, connections
were reset, the gateway came back as a new process). Where a bound is in seconds it keeps at
least 5x headroom over what bench/chaos.py measured (docs/reliability.md): a test asserts the
cause, the benchmark the speed.

Two faults share a cluster where one leaves it whole for the next (one `strata up` per class,
stopped with it): the session store's Redis killed, then the registry's Redis down (sessions
and registry each in a Redis of their own); an instance frozen, then the gateway restarted.
Each test first waits until the gateway routes to every instance again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import fault_scenarios as scenarios
from harness.faults import (
    FaultReport,
    LoadSize,
    Place,
    Timing,
    command_line,
    start_cluster,
    stop_cluster,
    up_args,
    wait_for_instances,
)
from harness.procs import Proc
from harness.redis_server import RedisServer
from redis_server import redis_server_binary

SIZE = LoadSize(num_conversations=4, num_streams=4, max_tokens=24)

pytestmark = pytest.mark.timeout(120)


def place(root: Path, with_redis: bool = False) -> Place:
    return Place(root, dict(os.environ), redis_server_binary() if with_redis else None)


@dataclass(frozen=True)
class Running:
    """A `strata up` (run dir `root / "run"`) started by `command`, of `num_instances`;
    `sessions` and `registry` the Redis servers it keeps them in, where it does."""

    up: Proc
    root: Path
    command: str
    num_instances: int
    sessions: RedisServer | None = None
    registry: RedisServer | None = None

    def whole(self) -> Running:
        """Once the gateway routes to every instance (after the previous fault)."""
        wait_for_instances(self.up.url, self.num_instances)
        return self


def show(report: FaultReport) -> FaultReport:
    print(report.row(), report.extra, report.errors)
    assert report.turns_acked > 0 and report.sent > report.failed
    assert report.turns_lost == 0
    return report


@pytest.fixture(scope="class")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """`strata up` of two, sessions and session pins in one durable Redis, the registry in
    another; for TestRedisDown, stopped after it."""
    root = tmp_path_factory.mktemp("chaos-redis")
    binary = place(root, True).redis_binary
    assert binary is not None
    sessions = RedisServer(root / "redis", binary, extra_args=scenarios.DURABLE)
    registry = RedisServer(root / "registry", binary, extra_args=scenarios.DURABLE)
    sessions.start()
    registry.start()
    args = up_args(root, 2, ["--registry", registry.url,
                             *scenarios.sessions_in_redis(sessions.url)])
    try:
        up = start_cluster(place(root), args)
        try:
            yield Running(up, root, command_line(args), 2, sessions, registry)
        finally:
            stop_cluster(up)
    finally:
        registry.stop()
        sessions.stop()


class TestRedisDown:
    """Sessions and session pins in one durable Redis, the registry in another."""

    def test_redis_sigkilled_under_multi_turn_load_loses_no_turn(self, redis_cluster: Running
                                                                 ) -> None:
        timing = Timing(before_s=2.0, fault_s=3.0, after_s=3.0)
        running = redis_cluster.whole()
        assert running.sessions is not None
        report = show(scenarios.redis_kill_on(running.up, running.sessions, running.command,
                                              timing, SIZE))
        # turns fail while Redis is down, and only then
        assert report.recovery_s < timing.fault_s + 2.0, report.recovery_s

    def test_a_registry_down_for_10s_fails_no_request(self, redis_cluster: Running) -> None:
        timing = Timing(before_s=2.0, fault_s=10.0, after_s=2.0)
        running = redis_cluster.whole()  # after the session store's restart
        assert running.registry is not None
        report = show(scenarios.registry_outage_on(running.up, running.registry,
                                                   running.command, timing, SIZE))
        assert report.failed == 0, report.errors
        assert report.extra["heartbeats_resumed_s"] < 10.0


def test_latency_and_resets_between_gateway_and_instances_fail_no_stream(
        tmp_path: Path) -> None:
    """Not "no request": a non-streamed session turn is not idempotent (docs/reliability.md).
    Its answer lost to a reset after the instance stored it, it is sent again and meets its
    own stored copy (409); a non-streamed request whose every retry meets a reset is a 502.
    Those are the only failures allowed, and never a stream's. The fault is its schedule
    (3 s of latency, then 3 s of resets), healed once that is done (no overrun)."""
    timing = Timing(before_s=2.0, fault_s=6.0, after_s=2.0)
    report = show(scenarios.network_faults(place(tmp_path), timing, SIZE, overrun=False))
    assert report.extra["connections_reset"] > 0
    failed = report.extra["failed_by_kind"]
    assert not [kind for kind in failed if "streamed" in kind], report.errors
    assert all(error[:4] in ("409:", "502:") for error in report.errors), report.errors


@pytest.fixture(scope="class")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """`strata up` of three, sessions in SQLite; for TestThreeInstances, stopped after it."""
    root = tmp_path_factory.mktemp("chaos-three")
    args = up_args(root, 3, ["--session-store", f"sqlite:///{root}/sessions.db"])
    up = start_cluster(place(root), args)
    try:
        yield Running(up, root, command_line(args), 3)
    finally:
        stop_cluster(up)


class TestThreeInstances:
    """Three simulated instances, sessions in SQLite."""

    def test_a_frozen_instance_fails_no_request_and_stalls_no_stream_2s(
            self, three: Running) -> None:
        timing = Timing(before_s=2.0, fault_s=3.0, after_s=3.0)
        running = three.whole()
        report = show(scenarios.instance_freeze_on(running.up, running.root, running.command,
                                                   timing, SIZE))
        # the freeze caught requests: the instance ran some as it stopped, and the stall watch
        # ended the gateway's waits on it (each resumed or retried elsewhere)
        assert report.extra["in_flight_at_fault"] >= 1, report.extra
        assert report.extra["stalled_attempts"] >= 1, report.extra
        assert report.failed == 0, report.errors
        assert report.max_stream_gap_s < 3.5  # bench/chaos.py: 0.65 s

    def test_a_gateway_sigkilled_under_load_is_back_within_seconds(self, three: Running
                                                                   ) -> None:
        timing = Timing(before_s=2.0, fault_s=0.5, after_s=5.0)
        running = three.whole()  # after the freeze: the thawed instance routed again
        report = show(scenarios.gateway_restart_on(running.up, running.root, running.command,
                                                   timing, SIZE))
        assert report.extra["restarted"] is True
        # what it carried failed, and what was sent before it listened again; nothing after
        assert report.extra["failed_after_back"] == 0, report.errors
        assert report.recovery_s < 15.0, report.recovery_s  # bench/chaos.py: 2.92 s
