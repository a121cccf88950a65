"""The local supervisor with real child processes and an injected clock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from strata.cluster.local import LocalClusterConfig, Supervisor
from strata.errors import ConfigError

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHER = [sys.executable, "-c", "raise SystemExit(3)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_supervisor(tmp_path: Path, clock: Clock, replicas: int = 2) -> Supervisor:
    config = LocalClusterConfig(replicas=replicas, run_dir=tmp_path, restart_backoff_s=1.0,
                                max_backoff_s=4.0, stable_after_s=10.0, stop_timeout_s=5.0)
    sup = Supervisor(config, clock=clock)
    for child in sup.children:
        child.argv = list(SLEEPER)
    return sup


def test_instances_get_distinct_ports_ids_and_the_shared_registry(tmp_path: Path) -> None:
    sup = Supervisor(LocalClusterConfig(replicas=3, run_dir=tmp_path, model="m",
                                        serve_args=("--dtype", "float32")))
    argvs = [c.argv for c in sup.instances]
    ports = {a[a.index("--port") + 1] for a in argvs}
    assert len(ports) == 3
    assert [a[a.index("--instance-id") + 1] for a in argvs] == [
        "instance-0", "instance-1", "instance-2"]
    assert all(a[a.index("--registry") + 1] == f"sqlite:///{tmp_path}/registry.db" for a in argvs)
    assert all(a[4] == "m" and a[-2:] == ["--dtype", "float32"] for a in argvs)
    assert sup.gateway.argv[sup.gateway.argv.index("--registry") + 1] == sup.config.registry_url


def test_a_crashed_instance_restarts_with_doubling_backoff_then_stop_ends_all(
    tmp_path: Path,
) -> None:
    clock = Clock()
    sup = make_supervisor(tmp_path, clock)
    sup.instances[0].argv = list(CRASHER)
    sup.start()
    try:
        crasher = sup.instances[0]
        assert crasher.proc is not None
        crasher.proc.wait(timeout=30)
        delays = []
        for _ in range(3):
            sup.poll()  # notices the exit, schedules a restart
            assert crasher.restart_at is not None
            delays.append(crasher.restart_at - clock.now)
            clock.now = crasher.restart_at
            sup.poll()  # restarts it
            assert crasher.proc is not None
            crasher.proc.wait(timeout=30)
        assert delays == [1.0, 2.0, 4.0]
        assert crasher.num_restarts == 3
        assert sup.instances[1].is_running and sup.gateway.is_running
        assert (tmp_path / "pids").read_text().count("\n") == 3
    finally:
        sup.stop()
    assert not any(c.is_running for c in sup.children)
    assert not (tmp_path / "pids").exists()


def test_backoff_resets_after_a_stable_run(tmp_path: Path) -> None:
    clock = Clock()
    sup = make_supervisor(tmp_path, clock, replicas=1)
    sup.start()
    try:
        child = sup.instances[0]
        child.backoff_s = 4.0
        clock.now = 11.0
        sup.poll()
        assert child.backoff_s == 0.0
    finally:
        sup.stop()


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="--replicas"):
        LocalClusterConfig(replicas=0, run_dir=Path("/tmp"))
