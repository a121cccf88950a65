"""`strata up`: a registry, instances and a gateway as local processes, supervised.

Which instances run is not fixed at start: each round (every `reconcile_interval_s`) the
supervisor reads the deployments in the model registry and reconciles toward them (see
strata/cluster/deployments.py): an ACTIVE name@version keeps exactly `replicas` instances
`{name}-{version}-{index}`; a RETIRING one is drained (SIGTERM: in-flight requests finish, the
instance deregisters and exits) and its record deleted once none is left. This is how a release
(`strata release`) starts new instances and retires old ones without starting processes itself.

The supervisor owns every process it starts: it restarts a crashed instance (same id, same port,
so it rejoins where it was) after an exponential backoff, never restarts one it drained, and on
stop sends SIGTERM to all of them, waits for their graceful shutdown and only then SIGKILLs what
is left.

Ports are found free, then bound by the child a moment later: another process may take one in
between, or while a crashed child is down. Before a restart the supervisor checks: an instance
whose port was taken moves to a fresh one (and registers its new URL); the gateway's port is
the user's, so losing it stops `strata up` with an error that says so.

Across restarts of `strata up` the model catalogue is kept; instances, deployments and routing
are re-seeded from the flags (strata/cluster/seed.py); unfinished releases are marked failed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from strata.clock import Clock
from strata.cluster.deployments import Slot, Start, instance_id_of
from strata.cluster.local_config import LocalClusterConfig, instance_argv, local_registry_url
from strata.cluster.ports import free_port, port_is_free
from strata.cluster.registry_link import Reconciler, RegistryLink
from strata.errors import ConfigError
from strata.registry.models import ModelVersion
from strata.registry.models.deployments import DEFAULT_POOL, MIXED

log = logging.getLogger("strata.up")


@dataclass(slots=True)
class Child:
    """One supervised process and its restart bookkeeping."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    num_restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)
    deployment: str = ""  # name@version of an instance; "" for the gateway
    index: int = 0
    role: str = MIXED
    pool: str = DEFAULT_POOL
    is_draining: bool = False  # sent SIGTERM by a reconcile: never restarted
    port: int = 0  # where it listens (0: not known)
    version: ModelVersion | None = None  # an instance's; None for the gateway

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts, watches and stops the processes of one local cluster."""

    def __init__(self, config: LocalClusterConfig, *, python: str = sys.executable,
                 clock: Clock = time.monotonic,
                 supervise_instances: bool = True, link: RegistryLink | None = None) -> None:
        """With `supervise_instances=False` only the gateway is a child (Ray owns instances).
        `link` reaches the registries (default: opened at start from the config's URL)."""
        self.config = config
        self._link = link
        self.python = python
        self.clock = clock
        self.supervise_instances = supervise_instances
        self.instances: dict[str, Child] = {}  # instance id -> child
        self.gateway = Child("gateway", self._gateway_argv(), config.log_dir / "gateway.log",
                             port=config.port)
        self._reconciler: Reconciler | None = None
        self._next_round_at = 0.0

    @property
    def children(self) -> list[Child]:
        return [*self.instances.values(), self.gateway]

    def _gateway_argv(self) -> list[str]:
        c = self.config
        return [self.python, "-m", "strata.cli", "gateway", "--host", c.host, "--port",
                str(c.port), "--registry", c.registry_url, *c.gateway_args]

    def start(self) -> None:
        """Start the gateway, then the instances the registry's deployments ask for."""
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(self.gateway)
        if self.supervise_instances:
            link = self._link or RegistryLink(self.config.registry_url)
            self._reconciler = Reconciler(link, start=self._start_instance, drain=self._drain)
            self._reconcile(self.clock())
        self._write_pids()

    def _spawn(self, child: Child) -> None:
        if child.log_file is None:
            child.log_file = open(child.log_path, "ab")  # noqa: SIM115 - closed in stop()
        child.proc = subprocess.Popen(child.argv, stdout=child.log_file,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child.started_at = self.clock()
        child.restart_at = None
        log.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)

    def _write_pids(self) -> None:
        lines = [f"{c.name} {c.proc.pid}" for c in self.children if c.proc is not None]
        (self.config.run_dir / "pids").write_text("\n".join(lines) + "\n")

    def poll(self) -> None:
        """One round: forget drained instances that exited, reconcile with the registry when
        due, then restart crashed children whose backoff has passed."""
        now = self.clock()
        self._collect_drained()
        if self._reconciler is not None and now >= self._next_round_at:
            self._reconcile(now)
        for child in self.children:
            if child.is_draining:
                continue
            if child.is_running:
                if now - child.started_at >= self.config.stable_after_s:
                    child.backoff_s = 0.0
                continue
            if child.restart_at is None:
                self._schedule_restart(child, now)
            elif now >= child.restart_at:
                child.num_restarts += 1
                self._move_if_port_taken(child)
                self._spawn(child)
                self._write_pids()

    def _reconcile(self, now: float) -> None:
        assert self._reconciler is not None
        self._next_round_at = now + self.config.reconcile_interval_s
        owned = {iid: Slot(c.deployment, c.index, c.is_draining, c.role, c.pool)
                 for iid, c in self.instances.items()}
        actions = self._reconciler.round(owned)
        if actions is not None and not actions.is_empty:
            self._write_pids()

    def _start_instance(self, start: Start) -> None:
        version, index = start.version, start.index
        instance_id = instance_id_of(version.name, version.version, index)
        port = free_port(self.config.host)
        argv = instance_argv(self.config, version, instance_id, port, self.python, index,
                             role=start.role, pool=start.pool)
        child = Child(instance_id, argv, self.config.log_dir / f"{instance_id}.log",
                      deployment=version.key, index=index, role=start.role, pool=start.pool,
                      port=port, version=version)
        self.instances[instance_id] = child
        self._spawn(child)

    def _move_if_port_taken(self, child: Child) -> None:
        """Before a restart: an instance whose port was taken moves; the gateway cannot."""
        host = self.config.host
        if child.port == 0 or port_is_free(child.port, host):
            return
        if child.version is None:
            raise ConfigError(f"port {child.port} on {host} is in use: the gateway cannot "
                              f"listen there; stop what holds it or pick another --port")
        port = free_port(host)
        log.warning("%s: port %d is taken by another process; restarting on %d", child.name,
                    child.port, port)
        child.port = port
        child.argv = instance_argv(self.config, child.version, child.name, port, self.python,
                                   child.index, role=child.role, pool=child.pool)

    def _drain(self, instance_id: str) -> None:
        child = self.instances[instance_id]
        child.is_draining = True
        if child.is_running and child.proc is not None:
            child.proc.send_signal(signal.SIGTERM)
            log.info("draining %s (pid %d)", instance_id, child.proc.pid)

    def _collect_drained(self) -> None:
        gone = [c for c in self.instances.values() if c.is_draining and not c.is_running]
        for child in gone:
            code = child.proc.returncode if child.proc is not None else None
            log.info("%s drained and exited with %s", child.name, code)
            _close_log(child)
            del self.instances[child.name]
        if gone:
            self._write_pids()

    def _schedule_restart(self, child: Child, now: float) -> None:
        c = self.config
        child.backoff_s = min(max(child.backoff_s * 2, c.restart_backoff_s), c.max_backoff_s)
        child.restart_at = now + child.backoff_s
        code = child.proc.returncode if child.proc is not None else None
        log.warning("%s exited with %s; restarting in %.1fs (see %s)", child.name, code,
                    child.backoff_s, child.log_path)

    def stop(self) -> None:
        """SIGTERM everything (gateway first, so no new traffic), wait, then SIGKILL."""
        for child in [self.gateway, *self.instances.values()]:
            # a draining child already has its SIGTERM; a second one would cut its drain short
            if child.is_running and child.proc is not None and not child.is_draining:
                child.proc.send_signal(signal.SIGTERM)
        deadline = self.clock() + self.config.stop_timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(deadline - self.clock(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.proc.kill()
                child.proc.wait()
            _close_log(child)
        if self._reconciler is not None:
            self._reconciler.link.close()
            self._reconciler = None
        pid_file = self.config.run_dir / "pids"
        if pid_file.exists():
            os.unlink(pid_file)

    def run_forever(self, should_stop: Callable[[], bool], interval_s: float = 0.5) -> None:
        while not should_stop():
            self.poll()
            time.sleep(interval_s)


def _close_log(child: Child) -> None:
    if child.log_file is not None:
        child.log_file.close()
        child.log_file = None


__all__ = ["Child", "LocalClusterConfig", "Supervisor", "free_port", "instance_argv",
           "local_registry_url"]
