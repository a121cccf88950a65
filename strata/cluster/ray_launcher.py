"""`strata up --ray`: instances as Ray actors, restarted by Ray when they die.

Each actor owns one `strata serve` child process (started with PDEATHSIG so that it dies with the
actor). When the child exits unexpectedly the actor exits too, and Ray restarts the actor, which
starts a new child on the same port with the same instance id: it re-registers and the gateway
sees it rejoin. The gateway itself runs on the driver, supervised like `strata up`.
Ray is imported lazily: it is an optional dependency (`pip install 'strata[ray]'`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.cluster.local import LocalClusterConfig, Supervisor, free_port, instance_argv
from strata.errors import ConfigError

log = logging.getLogger("strata.up.ray")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the actor process dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class InstanceActor:
    """A Ray actor that keeps one `strata serve` process alive for as long as it lives."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        self._stopping = False
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the actor
        self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        code = self._proc.wait()
        if not self._stopping:
            self._log.write(f"[strata] instance exited with {code}; the actor exits so that "
                            "Ray restarts it\n".encode())
            self._log.flush()
            os._exit(1)

    def pid(self) -> int:
        """The pid of the `strata serve` child (tests kill it to play a crash)."""
        return int(self._proc.pid)

    def actor_pid(self) -> int:
        return os.getpid()

    def stop(self, timeout_s: float) -> int | None:
        """Graceful stop: SIGTERM (drain, deregister), then SIGKILL after the timeout."""
        self._stopping = True
        self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


@dataclass(frozen=True, slots=True)
class RayClusterConfig:
    cluster: LocalClusterConfig
    address: str | None = None  # None: start (or join) a local Ray
    num_cpus_per_instance: float = 0.5

    def __post_init__(self) -> None:
        if self.num_cpus_per_instance <= 0:
            raise ConfigError("--num-cpus-per-instance must be > 0 (fractions are allowed)")
        if self.address and (self.cluster.registry or "").startswith("sqlite"):
            raise ConfigError(
                "a Ray cluster of several nodes needs a shared registry: pass --registry "
                "redis://HOST:PORT/0 (SQLite is one machine's file)"
            )


class RayLauncher:
    """Starts the actors and the gateway; stop() ends them in the right order."""

    def __init__(self, config: RayClusterConfig) -> None:
        self.config = config
        self.actors: list[Any] = []
        self.gateway = Supervisor(config.cluster, supervise_instances=False)
        self._started_ray = False

    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.config.address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
            self._started_ray = True
        self.gateway.start()  # first: it resets the cluster's registry file
        remote = ray.remote(InstanceActor)
        c = self.config.cluster
        for index in range(c.replicas):
            instance_id = f"instance-{index}"
            argv = instance_argv(c, instance_id, free_port(c.host), sys.executable)
            actor = remote.options(
                name=f"strata-{instance_id}", num_cpus=self.config.num_cpus_per_instance,
                max_restarts=-1, max_task_retries=-1,
            ).remote(argv, str(c.log_dir / f"{instance_id}.log"))
            self.actors.append(actor)
        ray.get([a.pid.remote() for a in self.actors])  # every actor constructed
        log.info("%d instance actors started", len(self.actors))

    def poll(self) -> None:
        self.gateway.poll()  # Ray restarts the actors; the driver keeps the gateway alive

    def stop(self) -> None:
        import ray

        timeout_s = self.config.cluster.stop_timeout_s
        self.gateway.stop()
        stops = [a.stop.remote(timeout_s) for a in self.actors]
        try:
            ray.get(stops, timeout=timeout_s + 5)
        except Exception as e:  # an actor that is restarting cannot answer; kill it anyway
            log.warning("some instances did not stop cleanly: %s", e)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()

    def run_forever(self, should_stop: Any, interval_s: float = 0.5) -> None:
        while not should_stop():
            self.poll()
            time.sleep(interval_s)
