"""The autoscaler inside a gateway process: its signals read from the gateway's own parts, its
decisions on the gateway's /metrics and dashboard.

    arrivals    the gateway's request counter of the two generation routes, sampled each round
    TTFT        time to the first byte of each successful attempt (a stream's first token)
    queued      requests waiting at the gateway (priority classes' flow control and admission)
    in flight   the gateway's own count of requests sent to the deployment's instances
    waiting,    what the instances last reported (registry heartbeats): engine queues, KV use
    KV usage
Only the lease holder decides; every gateway reads its own traffic, so run the autoscaler on the
gateway that takes the traffic (one gateway per cluster, as `strata up` has).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from strata.autoscale.controller import Autoscaler
from strata.autoscale.law import Signals
from strata.gateway.dashboard_data import AutoscalerStatus, ScalingTarget
from strata.gateway.instances import InstanceView
from strata.gateway.wiring import Gateway
from strata.registry.models import Deployment

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


class GatewaySignals:
    """Reads `Signals` from one gateway; `__call__(now, deployment)` once per round."""

    def __init__(self, gateway: Gateway, *, window_s: float, recent_s: float,
                 ttft_window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.gateway = gateway
        self.window_s = window_s
        self.recent_s = recent_s
        self.ttft_window_s = ttft_window_s
        self.clock = clock
        self._counts: deque[tuple[float, float]] = deque()  # (time, requests so far)
        self._ttfbs: deque[tuple[float, float]] = deque()
        gateway.proxy.observers.append(self._observe)

    def _observe(self, view: InstanceView, is_error: bool, ttfb_s: float | None) -> None:
        if not is_error and ttfb_s is not None:
            self._ttfbs.append((self.clock(), ttfb_s))

    def __call__(self, now: float, deployment: Deployment) -> Signals:
        count = self._requests_so_far()
        self._counts.append((now, count))
        while self._counts[0][0] < now - self.window_s - 1.0:
            self._counts.popleft()
        while self._ttfbs and self._ttfbs[0][0] < now - self.ttft_window_s:
            self._ttfbs.popleft()
        num_recent = count - self._count_at(now - self.recent_s)
        views = [v for v in self.gateway.source.instances.snapshot()
                 if v.model == deployment.name and v.version == deployment.version]
        ready = [v for v in views if v.is_routable]
        ttfbs = sorted(value for _, value in self._ttfbs)
        return Signals(
            now=now, desired=deployment.replicas, ready=len(ready),
            arrival_rate=(count - self._count_at(now - self.window_s)) / self.window_s,
            recent_rate=num_recent / self.recent_s, num_recent=round(num_recent),
            queued=self._queued(), waiting=sum(v.reported.num_waiting for v in ready),
            in_flight=sum(v.num_in_flight for v in views),
            in_flight_tokens=sum(v.num_in_flight_tokens for v in views),
            kv_usage=sum(v.reported.kv_usage for v in ready) / len(ready) if ready else 0.0,
            ttft_p95_s=ttfbs[int(0.95 * (len(ttfbs) - 1))] if ttfbs else None)

    def _requests_so_far(self) -> float:
        registry = self.gateway.metrics.registry
        return sum(registry.get_sample_value("strata:gateway_requests_total",
                                             {"endpoint": route}) or 0.0
                   for route in GENERATION_ROUTES)

    def _count_at(self, when: float) -> float:
        """The count at the newest sample not after `when` (the oldest one if none)."""
        found = self._counts[0][1]
        for at, count in self._counts:
            if at > when:
                break
            found = count
        return found

    def _queued(self) -> int:
        classes = self.gateway.classes
        return self.gateway.admission.num_queued + (classes.num_queued() if classes else 0)


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

    async def run(self) -> None:
        await self.autoscaler.run()

    async def status(self) -> AutoscalerStatus | None:
        last = self.autoscaler.last
        if last is None or not self.autoscaler.is_leader:
            return None
        d = last.deployment
        target = ScalingTarget(d.name, d.version, "mixed", "default", last.decision.desired,
                               last.signals.ready, last.decision.reason)
        return AutoscalerStatus(last.at, self.autoscaler.owner, (target,))


class AutoscalerMetrics(Collector):
    """`strata:autoscaler_*` on the gateway's /metrics."""

    def __init__(self, autoscaler: Autoscaler) -> None:
        self.autoscaler = autoscaler

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        a = self.autoscaler
        yield _gauge("strata:autoscaler_is_leader", "1 while this gateway's autoscaler holds "
                     "the lease.", float(a.is_leader))
        decisions = CounterMetricFamily("strata:autoscaler_decisions",
                                        "Decisions by direction and reason.",
                                        labels=["direction", "reason"])
        for (direction, reason), count in sorted(a.num_decisions.items()):
            decisions.add_metric([direction, reason], count)
        yield decisions
        if a.last is None:
            return
        s, decision = a.last.signals, a.last.decision
        yield _gauge("strata:autoscaler_desired_replicas", "Replicas the autoscaler wants.",
                     decision.desired)
        yield _gauge("strata:autoscaler_ready_replicas", "Replicas taking requests.", s.ready)
        yield _gauge("strata:autoscaler_needed_replicas", "Replicas the law asks for, before "
                     "dwell and bounds.", decision.needed)
        yield _gauge("strata:autoscaler_correction", "Measured / modelled requests in flight.",
                     decision.correction)
        signal = GaugeMetricFamily("strata:autoscaler_signal", "The signals of the last round.",
                                   labels=["name"])
        for name, value in (("arrival_rate", s.arrival_rate), ("recent_rate", s.recent_rate),
                            ("queued", s.queued), ("waiting", s.waiting),
                            ("in_flight", s.in_flight), ("in_flight_tokens", s.in_flight_tokens),
                            ("kv_usage", s.kv_usage), ("ttft_p95_s", s.ttft_p95_s)):
            if value is not None and math.isfinite(value):
                signal.add_metric([name], float(value))
        yield signal


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


__all__ = ["AutoscalerMetrics", "GatewayAutoscaler", "GatewaySignals"]
