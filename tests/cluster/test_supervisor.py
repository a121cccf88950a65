"""The local supervisor with real child processes, an injected clock and an in-process registry.

The children are a stand-in `python` (a shell script) that sleeps, or crashes for one instance
id: supervision and reconciliation are about processes, not about what they serve.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import stat
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from strata.clock import ManualClock
from strata.cluster.local import LocalClusterConfig, Supervisor, instance_argv
from strata.cluster.ports import free_port
from strata.cluster.registry_link import RegistryLink
from strata.errors import ConfigError
from strata.registry import create_registry
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelVersion,
    create_model_registry,
)

T = TypeVar("T")
V1 = ModelVersion("m", "v1", "/models/m1")


def fake_python(tmp_path: Path, crash_id: str = "none") -> str:
    """Sleeps like a server; exits 3 at once when it is instance `crash_id`."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\ncase "$*" in *"--instance-id {crash_id} "*) exit 3;; esac\n'
                      "exec sleep 60\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


class Harness:
    """A supervisor over a memory model registry that the test writes deployments into."""

    def __init__(self, tmp_path: Path, crash_id: str = "none") -> None:
        self.clock = ManualClock()
        self.models: ModelRegistry = create_model_registry("memory://")
        link = RegistryLink("memory://", models=self.models,
                            instances=create_registry("memory://"))
        self.link = link
        config = LocalClusterConfig(replicas=2, run_dir=tmp_path, restart_backoff_s=1.0,
                                    max_backoff_s=4.0, stable_after_s=10.0, stop_timeout_s=5.0,
                                    reconcile_interval_s=0.5)
        self.sup = Supervisor(config, python=fake_python(tmp_path, crash_id), clock=self.clock,
                              link=link)

    def write(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.link.run(coro)

    def deploy(self, replicas: int, state: DeploymentState = DeploymentState.ACTIVE) -> None:
        async def put() -> None:
            await self.models.add_version(V1)
            current = {d.key: d for d in await self.models.list_deployments()}.get(V1.key)
            await self.models.put_deployment(
                Deployment("m", "v1", replicas, state),
                expected_revision=current.revision if current else 0)

        self.write(put())

    def round(self) -> None:
        """Advance past the reconcile interval and poll."""
        self.clock.now += 0.5
        self.sup.poll()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.sup.stop()


def test_argv_of_an_instance_names_its_version_port_id_and_the_shared_registry(
    tmp_path: Path,
) -> None:
    config = LocalClusterConfig(replicas=1, run_dir=tmp_path, threads_per_instance=2,
                                serve_args=("--dtype", "float32", "--simulate", "x"))
    assert instance_argv(config, V1, "m-v1-0", 9001, "py") == [
        "py", "-m", "strata.cli", "serve", "/models/m1", "--served-model-name", "m",
        "--model-version", "v1", "--dtype", "float32",
        "--registry", f"sqlite:///{tmp_path.resolve()}/registry.db", "--instance-id", "m-v1-0",
        "--host", "127.0.0.1", "--port", "9001", "--advertise-url", "http://127.0.0.1:9001",
        "--threads", "2"]
    sim = ModelVersion("m", "v2", "sim:smollm2-cpu")
    assert "--threads" not in instance_argv(config, sim, "m-v2-0", 9002, "py")


def test_start_runs_what_the_deployment_asks_with_distinct_ports(harness: Harness) -> None:
    harness.deploy(replicas=3)
    harness.sup.start()
    assert list(harness.sup.instances) == ["m-v1-0", "m-v1-1", "m-v1-2"]
    argvs = [c.argv for c in harness.sup.instances.values()]
    assert len({a[a.index("--port") + 1] for a in argvs}) == 3
    assert all(c.is_running for c in harness.sup.children)
    assert (harness.sup.config.run_dir / "pids").read_text().count("\n") == 4


def test_a_crashed_instance_restarts_with_doubling_backoff_then_stop_ends_all(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, crash_id="m-v1-0")
    h.deploy(replicas=2)
    h.sup.start()
    try:
        crasher = h.sup.instances["m-v1-0"]
        assert crasher.proc is not None
        crasher.proc.wait(timeout=30)
        delays = []
        for _ in range(3):
            h.sup.poll()  # notices the exit, schedules a restart
            assert crasher.restart_at is not None
            delays.append(crasher.restart_at - h.clock.now)
            h.clock.now = crasher.restart_at
            h.sup.poll()  # restarts it (the reconcile round leaves it alone: it is wanted)
            assert crasher.proc is not None
            crasher.proc.wait(timeout=30)
        assert delays == [1.0, 2.0, 4.0]
        assert crasher.num_restarts == 3
        assert h.sup.instances["m-v1-1"].is_running and h.sup.gateway.is_running
        assert list(h.sup.instances) == ["m-v1-0", "m-v1-1"]
    finally:
        h.sup.stop()
    assert not any(c.is_running for c in h.sup.children)
    assert not (tmp_path / "pids").exists()


def test_a_crashed_instance_whose_port_was_taken_restarts_on_another(tmp_path: Path) -> None:
    h = Harness(tmp_path, crash_id="m-v1-0")
    h.deploy(replicas=1)
    h.sup.start()
    try:
        crasher = h.sup.instances["m-v1-0"]
        old_port = crasher.port
        assert crasher.proc is not None and crasher.proc.wait(timeout=30) == 3
        with socket.socket() as squatter:  # another process took the port meanwhile
            squatter.bind(("127.0.0.1", old_port))
            squatter.listen()
            h.sup.poll()  # notices the exit, schedules a restart
            assert crasher.restart_at is not None
            h.clock.now = crasher.restart_at
            h.sup.poll()  # restarts it on a fresh port
        argv = crasher.argv
        assert crasher.num_restarts == 1 and crasher.port != old_port
        assert argv[argv.index("--port") + 1] == str(crasher.port)
        assert argv[argv.index("--advertise-url") + 1] == f"http://127.0.0.1:{crasher.port}"
    finally:
        h.sup.stop()


def test_a_gateway_whose_port_was_taken_stops_the_cluster_with_an_error(tmp_path: Path) -> None:
    config = LocalClusterConfig(replicas=1, run_dir=tmp_path, port=free_port(),
                                stop_timeout_s=5.0)
    clock = ManualClock()
    sup = Supervisor(config, python=fake_python(tmp_path), clock=clock,
                     link=RegistryLink("memory://", models=create_model_registry("memory://"),
                                       instances=create_registry("memory://")))
    sup.start()
    try:
        assert sup.gateway.proc is not None
        sup.gateway.proc.kill()
        sup.gateway.proc.wait(timeout=30)
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", config.port))
            squatter.listen()
            sup.poll()
            assert sup.gateway.restart_at is not None
            clock.now = sup.gateway.restart_at
            with pytest.raises(ConfigError, match=f"port {config.port} on 127.0.0.1 is in use"):
                sup.poll()
    finally:
        sup.stop()


def test_backoff_resets_after_a_stable_run(harness: Harness) -> None:
    harness.deploy(replicas=1)
    harness.sup.start()
    child = harness.sup.instances["m-v1-0"]
    child.backoff_s = 4.0
    harness.clock.now = 11.0
    harness.sup.poll()
    assert child.backoff_s == 0.0


def test_scaling_down_drains_the_highest_index_and_never_restarts_it(harness: Harness) -> None:
    harness.deploy(replicas=2)
    harness.sup.start()
    drained = harness.sup.instances["m-v1-1"]
    harness.deploy(replicas=1)
    harness.round()
    assert drained.is_draining and drained.proc is not None
    assert drained.proc.wait(timeout=10) == -15  # SIGTERM, not SIGKILL
    harness.round()
    assert list(harness.sup.instances) == ["m-v1-0"]
    assert "m-v1-1" not in (harness.sup.config.run_dir / "pids").read_text()
    harness.deploy(replicas=2)  # its id is free again: a new process takes it
    harness.round()
    assert harness.sup.instances["m-v1-1"].is_running


def test_a_retiring_deployment_drains_and_is_deleted_once_none_is_left(
    harness: Harness,
) -> None:
    harness.deploy(replicas=2)
    harness.sup.start()
    procs = [c.proc for c in harness.sup.instances.values()]
    harness.deploy(replicas=2, state=DeploymentState.RETIRING)
    harness.round()
    assert [p.wait(timeout=10) for p in procs if p is not None] == [-15, -15]
    harness.round()  # forgets the exited instances; the next round deletes the record
    harness.round()
    assert harness.sup.instances == {}
    assert harness.write(harness.models.list_deployments()) == []


def test_a_version_missing_from_the_catalogue_is_logged_once(
    harness: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    harness.write(harness.models.put_deployment(Deployment("x", "v9", 1), expected_revision=0))
    with caplog.at_level(logging.WARNING, logger="strata.up"):
        harness.sup.start()
        harness.round()
        harness.round()
    assert [r.getMessage() for r in caplog.records] == [
        "deployments x@v9 name versions missing from the model catalogue; add them with "
        "`strata models add NAME@VERSION URI`"]
    assert harness.sup.instances == {}


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="--replicas"):
        LocalClusterConfig(replicas=0, run_dir=Path("/tmp"))
    with pytest.raises(ConfigError, match="reconcile_interval_s"):
        LocalClusterConfig(replicas=1, run_dir=Path("/tmp"), reconcile_interval_s=0)




def test_a_registry_it_cannot_open_is_logged_once_and_retried_until_it_can(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the registry's directory should be")
    url = f"sqlite:///{blocker}/registry.db"
    clock = ManualClock()
    config = LocalClusterConfig(replicas=1, run_dir=tmp_path, registry=url,
                                reconcile_interval_s=0.5, stop_timeout_s=5.0)
    sup = Supervisor(config, python=fake_python(tmp_path), clock=clock)
    try:
        with caplog.at_level(logging.WARNING, logger="strata.up"):
            sup.start()
            for _ in range(3):
                clock.now += 0.5
                sup.poll()
        assert len(caplog.records) == 1
        assert caplog.records[0].getMessage().startswith(f"reconcile with registry {url} failed")
        assert sup.gateway.is_running and sup.instances == {}

        blocker.unlink()
        blocker.mkdir()

        async def deploy() -> None:
            models = create_model_registry(url)
            await models.add_version(V1)
            await models.put_deployment(Deployment("m", "v1", 1), expected_revision=0)
            await models.close()

        asyncio.run(deploy())
        clock.now += 0.5
        sup.poll()
        assert list(sup.instances) == ["m-v1-0"]
    finally:
        sup.stop()
