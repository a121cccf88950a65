"""The fault scenarios of tests/harness/faults.py, one function each: `(place, timing, size) ->
FaultReport`. Redis comes from `place.redis_binary` (tests/harness/redis_server.py finds one)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

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
from harness.procs import spawn, stop_all, wait_until
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
    after `fault_s` on the same port with its append-only file."""
    root = place.root
    redis = RedisServer(root / "redis", _binary(place), extra_args=DURABLE)
    redis.start()
    args = up_args(root, 2, ["--session-store", redis.url, "--gateway-arg=--session-routing=hybrid",
                             f"--gateway-arg=--session-store={redis.url}"])
    up = start_cluster(place, args)
    try:
        before = gateway_counter(up.url, *RESUMED)
        load, result, fault_at = run_with_load(up.url, size, timing,
                                               lambda: redis.stop(kill=True), redis.start)
        return report("Redis (sessions, pins) SIGKILLed, restarted", command_line(args),
                      up.url, load, result, fault_at, resumed_since(up.url, before))
    finally:
        stop_cluster(up)
        redis.stop()


def registry_outage(place: Place, timing: Timing, size: LoadSize) -> FaultReport:
    """The registry (Redis) unreachable for `fault_s`: gateways route on their last view,
    instances serve, heartbeats resume once it is back (`extra.heartbeats_resumed_s`)."""
    root = place.root
    redis = RedisServer(root / "registry", _binary(place), extra_args=DURABLE)
    redis.start()
    args = up_args(root, 2, ["--registry", redis.url,
                             "--session-store", f"sqlite:///{root}/sessions.db"])
    up = start_cluster(place, args)
    resumed_after_s: list[float] = []

    def restart() -> None:
        redis.start()
        resumed_after_s.append(heartbeats_resumed_s(redis.url, time.time(), 2))

    try:
        before = gateway_counter(up.url, *RESUMED)
        load, result, fault_at = run_with_load(up.url, size, timing,
                                               lambda: redis.stop(kill=True), restart)
        return report("registry (Redis) down", command_line(args), up.url, load, result,
                      fault_at, resumed_since(up.url, before),
                      {"outage_s": timing.fault_s, "heartbeats_resumed_s": resumed_after_s[0]})
    finally:
        stop_cluster(up)
        redis.stop()


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
    """An instance SIGSTOPped for `fault_s` (its sockets stay open), then SIGCONTed."""
    root = place.root
    args = up_args(root, 3, ["--session-store", f"sqlite:///{root}/sessions.db"])
    up = start_cluster(place, args)
    try:
        victim = pids(root)[f"{MODEL}-default-1"]
        before = gateway_counter(up.url, *RESUMED)
        load, result, fault_at = run_with_load(
            up.url, size, timing, lambda: os.kill(victim, signal.SIGSTOP),
            lambda: os.kill(victim, signal.SIGCONT))
        return report("instance frozen (SIGSTOP)", command_line(args), up.url, load, result,
                      fault_at, resumed_since(up.url, before), {"frozen_s": timing.fault_s})
    finally:
        stop_cluster(up)


def network_faults(place: Place, timing: Timing, size: LoadSize, *, latency_s: float = 0.05,
                   reset_every_s: float = 1.0, reset_probability: float = 0.05) -> FaultReport:
    """Three instances behind TCP proxies: for the first half of `fault_s` every chunk waits
    `latency_s` each way; for the second half every open connection of one proxy (in turn) is
    reset every `reset_every_s`, and each new connection is reset with `reset_probability`."""
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
        load, result, fault_at = run_with_load(
            url, size, timing, lambda: _network_faults(proxies, timing.fault_s, latency_s,
                                                       reset_every_s, reset_probability),
            lambda: _heal(proxies))
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
    """The gateway SIGKILLed under load; `strata up` restarts it on the same port."""
    root = place.root
    args = up_args(root, 2, ["--session-store", f"sqlite:///{root}/sessions.db"])
    up = start_cluster(place, args)
    try:
        load, result, fault_at = run_with_load(
            up.url, size, timing, lambda: os.kill(pids(root)["gateway"], signal.SIGKILL),
            lambda: None)
        return report("gateway SIGKILLed, restarted", command_line(args), up.url, load,
                      result, fault_at, gateway_counter(up.url, *RESUMED))
    finally:
        stop_cluster(up)

__all__ = ["gateway_restart", "instance_freeze", "network_faults", "redis_kill",
           "registry_outage"]
