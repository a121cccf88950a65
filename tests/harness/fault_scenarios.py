"""The fault scenarios of tests/harness/faults.py, one function each: `(place, timing, size) ->
FaultReport`. Redis comes from `place.redis_binary` (tests/harness/redis_server.py finds one)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from harness import pooled_http
from harness.chaos_load import gateway_counter
from harness.faults import (
    MODEL,
    PROFILE,
    RESUMED,
    FaultReport,
    LoadSize,
    Place,
    Timing,
    command_line,
    pids,
    report,
    resumed_since,
    run_with_load,
    start_cluster,
    stop_cluster,
    up_args,
    wait_for_instances,
)
from harness.procs import Proc, spawn, stop_all, wait_until
from harness.redis_server import RedisServer
from harness.tcp_proxy import ChaosProxy
from strata.cluster.ports import free_port

DURABLE = ["--appendonly", "yes", "--appendfsync", "always"]


def _binary(place: Place) -> Path:
    if place.redis_binary is None:
        raise ValueError("this scenario needs a redis-server binary (Place.redis_binary)")
    return place.redis_binary


def redis_kill(place: Place, timing: Timing, size: LoadSize) -> FaultReport:
    """Sessions and session pins in Redis; Redis SIGKILLed under multi-turn load, restarted
    after `fault_s` on the same port with its append-only file (`redis_kill_on`)."""
    root = place.root
    redis = RedisServer(root / "redis", _binary(place), extra_args=DURABLE)
    redis.start()
    args = up_args(root, 2, sessions_in_redis(redis.url))
    up = start_cluster(place, args)
    try:
        return redis_kill_on(up, redis, command_line(args), timing, size)
    finally:
        stop_cluster(up)
        redis.stop()


def sessions_in_redis(url: str) -> list[str]:
    """`strata up` flags: sessions and the gateway's session pins in the Redis at `url`."""
    return ["--session-store", url, "--gateway-arg=--session-routing=hybrid",
            f"--gateway-arg=--session-store={url}"]


def redis_kill_on(up: Proc, redis: RedisServer, command: str, timing: Timing,
                  size: LoadSize) -> FaultReport:
    """`redis_kill` on a running `strata up` (started by `command`) whose sessions and session
    pins are in `redis` (durable: DURABLE)."""
    before = gateway_counter(up.url, *RESUMED)
    load, result, fault_at = run_with_load(up.url, size, timing,
                                           lambda: redis.stop(kill=True), redis.start)
    return report("Redis (sessions, pins) SIGKILLed, restarted", command, up.url, load,
                  result, fault_at, resumed_since(up.url, before))


def registry_outage(place: Place, timing: Timing, size: LoadSize) -> FaultReport:
    """The registry (Redis) unreachable for `fault_s` (`registry_outage_on`)."""
    root = place.root
    redis = RedisServer(root / "registry", _binary(place), extra_args=DURABLE)
    redis.start()
    args = up_args(root, 2, ["--registry", redis.url,
                             "--session-store", f"sqlite:///{root}/sessions.db"])
    up = start_cluster(place, args)
    try:
        return registry_outage_on(up, redis, command_line(args), timing, size)
    finally:
        stop_cluster(up)
        redis.stop()


def registry_outage_on(up: Proc, redis: RedisServer, command: str, timing: Timing,
                       size: LoadSize, num_instances: int = 2) -> FaultReport:
    """`registry_outage` on a running `strata up` (started by `command`) of `num_instances`
    whose registry is `redis` (durable): gateways route on their last view, instances serve,
    heartbeats resume once it is back (`extra.heartbeats_resumed_s`)."""
    resumed_after_s: list[float] = []

    def restart() -> None:
        redis.start()
        resumed_after_s.append(heartbeats_resumed_s(redis.url, time.time(), num_instances))

    before = gateway_counter(up.url, *RESUMED)
    load, result, fault_at = run_with_load(up.url, size, timing,
                                           lambda: redis.stop(kill=True), restart)
    return report("registry (Redis) down", command, up.url, load, result,
                  fault_at, resumed_since(up.url, before),
                  {"outage_s": timing.fault_s, "heartbeats_resumed_s": resumed_after_s[0]})


def heartbeats_resumed_s(url: str, since: float, num: int, timeout_s: float = 30.0) -> float:
    """Seconds from `since` (wall clock) until `num` instances heartbeat again."""
    from strata.registry import create_registry

    async def fresh() -> int:
        registry = create_registry(url)
        try:
            records = await registry.list_instances()
        finally:
            await registry.close()
        return sum(1 for r in records if r.last_heartbeat > since)

    wait_until(lambda: asyncio.run(fresh()) >= num, timeout_s, "heartbeats", interval_s=0.1)
    return round(time.time() - since, 2)


def instance_freeze(place: Place, timing: Timing, size: LoadSize) -> FaultReport:
    """An instance SIGSTOPped for `fault_s` (its sockets stay open), then SIGCONTed, on a
    cluster of three started for it (`instance_freeze_on`)."""
    return _on_own_cluster(place, 3, instance_freeze_on, timing, size)


def _on_own_cluster(place: Place, num_instances: int,
                    fault_on: Callable[[Proc, Path, str, Timing, LoadSize], FaultReport],
                    timing: Timing, size: LoadSize) -> FaultReport:
    """`fault_on` run on a `strata up` of `num_instances` (sessions in SQLite) started for it
    and stopped after."""
    args = up_args(place.root, num_instances,
                   ["--session-store", f"sqlite:///{place.root}/sessions.db"])
    up = start_cluster(place, args)
    try:
        return fault_on(up, place.root, command_line(args), timing, size)
    finally:
        stop_cluster(up)


def instance_freeze_on(up: Proc, root: Path, command: str, timing: Timing,
                       size: LoadSize) -> FaultReport:
    """`instance_freeze` on a running `strata up` (run dir `root / "run"`, started by
    `command`) whose instance 1 the gateway routes to. The instance is frozen while it runs
    requests (`extra.in_flight_at_fault`, read from its /metrics just before);
    `extra.stalled_attempts` counts the gateway's attempts on it that the stall watch ended:
    the requests the freeze caught, which had to be resumed or retried elsewhere."""
    name = f"{MODEL}-default-1"
    victim, victim_url = pids(root)[name], instance_url(up.url, name)
    stalled = ("strata:gateway_stalled_attempts_total", f'instance="{name}"')
    before, stalled_before = gateway_counter(up.url, *RESUMED), gateway_counter(up.url,
                                                                                *stalled)
    in_flight: list[float] = []

    def freeze() -> None:
        in_flight.append(wait_for_running(victim_url))
        os.kill(victim, signal.SIGSTOP)

    load, result, fault_at = run_with_load(up.url, size, timing, freeze,
                                           lambda: os.kill(victim, signal.SIGCONT))
    return report("instance frozen (SIGSTOP)", command, up.url, load, result,
                  fault_at, resumed_since(up.url, before),
                  {"frozen_s": timing.fault_s, "in_flight_at_fault": in_flight[0],
                   "stalled_attempts": gateway_counter(up.url, *stalled) - stalled_before})


def instance_url(gateway_url: str, instance_id: str) -> str:
    views = pooled_http.get(f"{gateway_url}/admin/instances", timeout=5).json()["instances"]
    url: str = next(v["url"] for v in views if v["instance_id"] == instance_id)
    return url


def wait_for_running(url: str, timeout_s: float = 10.0) -> float:
    """Wait until the instance at `url` runs a request; return how many it runs."""
    found: list[float] = []

    def running() -> bool:
        text = pooled_http.get(f"{url}/metrics", timeout=2).text
        found[:] = [sum(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("strata:num_requests_running"))]
        return found[0] > 0

    wait_until(running, timeout_s, "a request running on the instance", interval_s=0.01)
    return found[0]


def network_faults(place: Place, timing: Timing, size: LoadSize, *, latency_s: float = 0.05,
                   reset_every_s: float = 1.0, reset_probability: float = 0.05,
                   overrun: bool = True) -> FaultReport:
    """Three instances behind TCP proxies: for the first half of `fault_s` every chunk waits
    `latency_s` each way; for the second half every open connection of one proxy (in turn) is
    reset every `reset_every_s`, and each new connection is reset with `reset_probability`.
    With `overrun` (as bench/chaos.py has measured it) the schedule runs before the fault's
    `fault_s` wait, so new connections are still reset with `reset_probability` for another
    `fault_s` before the proxies heal; without it the schedule runs during that wait, and the
    proxies heal once it is done."""
    root = place.root
    PROFILE.save(root / "profile.json")
    registry = f"sqlite:///{root}/registry.db"
    python, logs = sys.executable, root / "logs"
    proxies, procs = [], []
    try:
        for i in range(3):
            port = free_port()
            proxies.append(ChaosProxy(port, seed=i).start())
            procs.append(spawn(f"instance-{i}", [
                python, "-m", "strata.cli", "serve", "--simulate", str(root / "profile.json"),
                "--served-model-name", MODEL, "--port", str(port), "--registry", registry,
                "--instance-id", f"sim-{i}", "--advertise-url", proxies[-1].url,
                "--session-store", f"sqlite:///{root}/sessions.db", "--log-level", "warning"],
                logs, env=dict(place.env)))
        gateway = spawn("gateway", [python, "-m", "strata.cli", "gateway", "--registry",
                                    registry, "--port", "0", "--log-level", "warning"], logs,
                        env=dict(place.env))
        procs.append(gateway)
        url = gateway.wait_for_output(r"Strata gateway on (\S+)", 60).group(1)
        wait_for_instances(url, 3)
        before = gateway_counter(url, *RESUMED)

        def faults() -> None:
            _network_faults(proxies, timing.fault_s, latency_s, reset_every_s,
                            reset_probability)

        during = threading.Thread(target=faults, daemon=True, name="network-faults")

        def heal() -> None:
            if during.ident is not None:  # started: the schedule ends first
                during.join()
            _heal(proxies)

        load, result, fault_at = run_with_load(url, size, timing,
                                               faults if overrun else during.start, heal)
        resets = sum(p.num_resets for p in proxies)
        return report("latency and resets (TCP proxy)",
                      "strata serve x3 behind harness.tcp_proxy; strata gateway", url,
                      load, result, fault_at, resumed_since(url, before),
                      {"latency_s": latency_s, "connections_reset": resets})
    finally:
        stop_all(procs)
        for proxy in proxies:
            proxy.stop()


def _network_faults(proxies: list[ChaosProxy], fault_s: float, latency_s: float,
                    reset_every_s: float, reset_probability: float) -> None:
    for proxy in proxies:
        proxy.latency_s = latency_s
    time.sleep(fault_s / 2)
    for proxy in proxies:
        proxy.latency_s, proxy.reset_probability = 0.0, reset_probability
    rng = random.Random(0)
    deadline = time.monotonic() + fault_s / 2
    while time.monotonic() < deadline:
        rng.choice(proxies).reset_all()
        time.sleep(reset_every_s)


def _heal(proxies: list[ChaosProxy]) -> None:
    for proxy in proxies:
        proxy.latency_s, proxy.reset_probability = 0.0, 0.0


def gateway_restart(place: Place, timing: Timing, size: LoadSize) -> FaultReport:
    """The gateway SIGKILLed under load; `strata up` restarts it on the same port (on a
    cluster of two started for it: `gateway_restart_on`)."""
    return _on_own_cluster(place, 2, gateway_restart_on, timing, size)


def gateway_restart_on(up: Proc, root: Path, command: str, timing: Timing,
                       size: LoadSize) -> FaultReport:
    """`gateway_restart` on a running `strata up` (run dir `root / "run"`, started by
    `command`). `extra.restarted` says a new gateway process answers;
    `extra.failed_after_back` counts the failed tries that started once it answered (what a
    restart may not cost)."""
    killed: list[int] = []
    back_at: list[float] = []

    def kill() -> None:
        killed.append(pids(root)["gateway"])
        os.kill(killed[0], signal.SIGKILL)

    def answering() -> bool:
        try:
            return pids(root)["gateway"] != killed[0] and \
                pooled_http.get(f"{up.url}/health", timeout=1).status_code == 200
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    def wait_back() -> None:
        wait_until(answering, 60, "the restarted gateway", interval_s=0.05)
        back_at.append(time.monotonic())

    load, result, fault_at = run_with_load(up.url, size, timing, kill, wait_back)
    failed_after = [o for o in result.failures if o.started_at >= back_at[0]]
    return report("gateway SIGKILLed, restarted", command, up.url, load,
                  result, fault_at, gateway_counter(up.url, *RESUMED),
                  {"restarted": pids(root)["gateway"] != killed[0],
                   "back_after_s": round(back_at[0] - fault_at, 2),
                   "failed_after_back": len(failed_after)})

__all__ = ["DURABLE", "gateway_restart", "gateway_restart_on", "instance_freeze",
           "instance_freeze_on", "network_faults", "redis_kill", "redis_kill_on",
           "registry_outage", "registry_outage_on", "sessions_in_redis"]
