"""The autoscaler on the gateway's /metrics (`strata:autoscaler_*`) and dashboard.

The deployment as a whole (desired, ready and needed replicas summed over its pools; the
signals and decisions of its first pool) keeps the names it had before pools;
`strata:autoscaler_pool_*` carry the same per pool, with a `pool` label (prefill, decode, a
class pool's name; `mixed` for a deployment of one mixed pool).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from strata.autoscale.controller import Autoscaler
from strata.autoscale.law import Signals
from strata.autoscale.status import AutoscalerStatus, ScalingTarget


class AutoscalerMetrics(Collector):
    def __init__(self, autoscaler: Autoscaler) -> None:
        self.autoscaler = autoscaler

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        a = self.autoscaler
        yield _gauge("strata:autoscaler_is_leader", "1 while this gateway's autoscaler holds "
                     "the lease.", float(a.is_leader))
        decisions = CounterMetricFamily("strata:autoscaler_decisions",
                                        "Decisions by direction and reason (all pools).",
                                        labels=["direction", "reason"])
        for (direction, reason), count in sorted(a.num_decisions.items()):
            decisions.add_metric([direction, reason], count)
        yield decisions
        by_pool = CounterMetricFamily("strata:autoscaler_pool_decisions",
                                      "Decisions by pool, direction and reason.",
                                      labels=["pool", "direction", "reason"])
        for key, count in sorted(a.num_pool_decisions.items()):
            by_pool.add_metric(list(key), count)
        yield by_pool
        if a.last is None:
            return
        pools = a.last.pools
        yield _gauge("strata:autoscaler_desired_replicas", "Replicas the autoscaler wants.",
                     sum(p.decision.desired for p in pools))
        yield _gauge("strata:autoscaler_ready_replicas", "Replicas taking requests.",
                     sum(p.signals.ready for p in pools))
        yield _gauge("strata:autoscaler_needed_replicas", "Replicas the law asks for, before "
                     "dwell and bounds.", sum(p.decision.needed for p in pools))
        yield _gauge("strata:autoscaler_correction", "Measured / modelled requests in flight.",
                     a.last.decision.correction)
        signal = GaugeMetricFamily("strata:autoscaler_signal", "The signals of the last round.",
                                   labels=["name"])
        for name, value in _signal_values(a.last.signals):
            signal.add_metric([name], value)
        yield signal
        replicas = GaugeMetricFamily("strata:autoscaler_pool_replicas", "Replicas of each pool: "
                                     "desired, ready, needed (before dwell and bounds).",
                                     labels=["pool", "kind"])
        pool_signal = GaugeMetricFamily("strata:autoscaler_pool_signal",
                                        "The signals of each pool in the last round, and its "
                                        "targets (ttft_slo_s, itl_slo_s: its classes').",
                                        labels=["pool", "name"])
        for p in pools:
            for kind, value in (("desired", p.decision.desired), ("ready", p.signals.ready),
                                ("needed", p.decision.needed)):
                replicas.add_metric([p.pool.label, kind], float(value))
            for name, value in _signal_values(p.signals):
                pool_signal.add_metric([p.pool.label, name], value)
            targets = a.law_of(p.pool).config  # the pool's own, from its classes' SLOs
            pool_signal.add_metric([p.pool.label, "ttft_slo_s"], targets.ttft_slo_s)
            pool_signal.add_metric([p.pool.label, "itl_slo_s"], targets.itl_slo_s)
        yield replicas
        yield pool_signal


def autoscaler_status(autoscaler: Autoscaler) -> AutoscalerStatus | None:
    """The dashboard's view: one target per pool."""
    last = autoscaler.last
    if last is None or not autoscaler.is_leader:
        return None
    d = last.deployment
    targets = tuple(ScalingTarget(d.name, d.version, p.pool.role, p.pool.pool,
                                  p.decision.desired, p.signals.ready, p.decision.reason)
                    for p in last.pools)
    return AutoscalerStatus(last.at, autoscaler.owner, targets)


def _signal_values(s: Signals) -> Iterator[tuple[str, float]]:
    for name, value in (("arrival_rate", s.arrival_rate), ("recent_rate", s.recent_rate),
                        ("queued", s.queued), ("waiting", s.waiting), ("running", s.running),
                        ("in_flight", s.in_flight), ("in_flight_tokens", s.in_flight_tokens),
                        ("kv_usage", s.kv_usage), ("ttft_p95_s", s.ttft_p95_s),
                        ("itl_p95_s", s.itl_p95_s)):
        if value is not None and math.isfinite(value):
            yield name, float(value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


__all__ = ["AutoscalerMetrics", "autoscaler_status"]
