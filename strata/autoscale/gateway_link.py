"""The autoscaler inside a gateway process: its signals read from the gateway's own parts, pool
by pool, its decisions on the gateway's /metrics and dashboard (gateway_metrics.py).

    arrivals    a prefill pool: the requests the gateway hands to a prefill instance; a decode
                or mixed pool: the requests placed in its pool name by the priority classes'
                flow (strata/gateway/path/classes.py), else every request that entered the
                gateway's path. Sampled each round
    TTFT        time to the first byte of each successful attempt (a stream's first token) on
                the pool's instances (a prefill pool: the client's, on the decode instance of
                its pool name); none for a decode pool, whose SLO is the ITL (law.py)
    ITL         the gaps between the chunks the gateway relays from the pool's instances
    queued      requests waiting at the gateway for the pool (admission, and the classes that
                live in it); none for a prefill pool (the gateway never waits for one)
    in flight,  the gateway's own count of requests and prompt tokens at the pool's instances
    tokens
    waiting,    what the pool's instances last reported (registry heartbeats): engine queues,
    running, KV running sequences, KV use
All of it comes from the gateway's typed parts (its `GatewayStats`, strata/gateway/stats.py,
its instance set, admission and class flow), never from /metrics samples. Only the lease holder
decides; every gateway reads its own traffic, so run the autoscaler on the
gateway that takes the traffic (one gateway per cluster, as `strata up` has).
"""

from __future__ import annotations

import time
from collections import deque

from strata.autoscale.controller import Autoscaler
from strata.autoscale.gateway_metrics import AutoscalerMetrics, autoscaler_status
from strata.autoscale.law import Signals
from strata.autoscale.status import AutoscalerStatus
from strata.clock import Clock
from strata.gateway.stats import p95
from strata.gateway.wiring import Gateway
from strata.registry.models import Deployment, PoolSize


class GatewaySignals:
    """Reads `Signals` from one gateway; `__call__(now, deployment)` once per pool per round
    (the deployment as that pool sees it: controller.py)."""

    def __init__(self, gateway: Gateway, *, window_s: float, recent_s: float,
                 ttft_window_s: float, clock: Clock = time.monotonic) -> None:
        self.gateway = gateway
        self.window_s = window_s
        self.recent_s = recent_s
        self.ttft_window_s = ttft_window_s
        self.clock = clock
        self._counts: dict[str, deque[tuple[float, float]]] = {}  # pool -> (time, so far)

    def __call__(self, now: float, deployment: Deployment) -> Signals:
        pool, stats = deployment.pools[0], self.gateway.stats
        counts = self._counts.setdefault(pool.label, deque())
        count = self._arrivals_so_far(pool)
        counts.append((now, count))
        while counts[0][0] < now - self.window_s - 1.0:
            counts.popleft()
        num_recent = count - _count_at(counts, now - self.recent_s)
        views = [v for v in self.gateway.source.instances.snapshot()
                 if v.model == deployment.name and v.version == deployment.version
                 and (v.role, v.pool) == (pool.role, pool.pool)]
        ready = [v for v in views if v.is_routable]
        since = self.clock() - self.ttft_window_s
        ttfbs = [] if pool.role == "decode" else stats.since(stats.first_bytes, since, [pool.pool])
        return Signals(
            now=now, desired=deployment.replicas, ready=len(ready),
            arrival_rate=(count - _count_at(counts, now - self.window_s)) / self.window_s,
            recent_rate=num_recent / self.recent_s, num_recent=round(num_recent),
            queued=self._queued(pool),
            waiting=sum(v.reported.num_waiting for v in ready),
            running=sum(v.reported.num_running for v in ready),
            in_flight=sum(v.num_in_flight for v in views),
            in_flight_tokens=sum(v.num_in_flight_tokens for v in views),
            kv_usage=sum(v.reported.kv_usage for v in ready) / len(ready) if ready else 0.0,
            ttft_p95_s=p95(ttfbs),
            itl_p95_s=p95(stats.since(stats.gaps, since, [pool.pool])))

    def _arrivals_so_far(self, pool: PoolSize) -> float:
        stats, classes = self.gateway.stats, self.gateway.classes
        if pool.role == "prefill":
            return float(stats.num_remote_prefills)
        if classes is not None:  # requests are placed in pools by class
            return float(classes.num_placed.get(pool.pool, 0))
        return float(stats.num_requests)

    def _queued(self, pool: PoolSize) -> int:
        if pool.role == "prefill":
            return 0
        classes = self.gateway.classes
        queued = self.gateway.admission.num_queued
        return queued if classes is None else queued + classes.num_queued_for(pool.pool)


def _count_at(counts: deque[tuple[float, float]], when: float) -> float:
    """The count at the newest sample not after `when` (the oldest one if none)."""
    found = counts[0][1]
    for at, count in counts:
        if at > when:
            break
        found = count
    return found


class GatewayAutoscaler:
    """What `create_gateway_app(autoscaler=...)` runs: attached once the gateway is built."""

    def __init__(self, autoscaler: Autoscaler) -> None:
        self.autoscaler = autoscaler

    def attach(self, gateway: Gateway) -> None:
        cfg = self.autoscaler.config
        self.autoscaler.read_signals = GatewaySignals(
            gateway, window_s=cfg.window_s, recent_s=cfg.recent_s,
            ttft_window_s=cfg.ttft_window_s, clock=self.autoscaler.clock)
        gateway.metrics.registry.register(AutoscalerMetrics(self.autoscaler))
        if gateway.classes is not None:  # requests wait for the instances it starts
            gateway.classes.bound.signs.append(self.is_growing)

    def is_growing(self) -> bool:
        """True while this autoscaler leads and wants more replicas than are ready."""
        last = self.autoscaler.last
        return self.autoscaler.is_leader and last is not None and any(
            p.decision.desired > p.signals.ready for p in last.pools)

    async def run(self) -> None:
        await self.autoscaler.run()

    async def status(self) -> AutoscalerStatus | None:
        return autoscaler_status(self.autoscaler)


__all__ = ["AutoscalerMetrics", "GatewayAutoscaler", "GatewaySignals"]
