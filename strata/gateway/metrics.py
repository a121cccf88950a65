"""Prometheus metrics of one gateway, on its own `CollectorRegistry` (never the global one).

`strata:gateway_added_latency_seconds` is the gateway's overhead on a request: from the moment the
request was received to the moment its upstream request was sent, plus the time from the upstream
headers (and first chunk) arriving to their being handed to the client.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                       0.25, 1.0)


class CountByLabel:
    """A one-label counter's children, each looked up once (prometheus_client's `labels()`
    checks its arguments, takes a lock and builds a tuple on every call)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.children: dict[str, Counter] = {}

    def inc(self, label: str) -> None:
        child = self.children.get(label)
        if child is None:
            child = self.children[label] = self.counter.labels(label)
        child.inc()


class GatewayMetrics:
    """The `strata:gateway_*` metrics."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("strata:gateway_requests_total", "Requests received.",
                                ["endpoint"], registry=reg)
        self.errors = Counter("strata:gateway_errors_total",
                              "Requests answered with an error by the gateway itself.",
                              ["reason"], registry=reg)
        self.retries = Counter("strata:gateway_retries_total", "Retries on another instance.",
                               registry=reg)
        self.ejections = Counter("strata:gateway_ejections_total", "Instances ejected.",
                                 ["instance"], registry=reg)
        self.routed = Counter("strata:gateway_routing_decisions_total",
                              "Attempts sent to each instance.", ["instance"], registry=reg)
        self.upstream_failures = Counter("strata:gateway_upstream_failures_total",
                                         "Failed attempts per instance.", ["instance"],
                                         registry=reg)
        self.broken_streams = Counter("strata:gateway_broken_streams_total",
                                      "Streams cut by an instance failure after they started.",
                                      registry=reg)
        self.resumes = Counter("strata:gateway_stream_resumes_total",
                               "Broken streams: resumed on another instance, impossible to "
                               "resume, or every resume attempt failed.", ["outcome"],
                               registry=reg)
        self.stalls = Counter("strata:gateway_stalled_attempts_total",
                              "Attempts ended because their instance went silent and failed a "
                              "probe.", ["instance"], registry=reg)
        self.recovery_waits = Counter("strata:gateway_recovery_waits_total",
                                      "Requests that found their model's fleet down and waited "
                                      "for an instance to come back, by outcome (recovered, "
                                      "timed_out).", ["outcome"], registry=reg)
        for outcome in ("recovered", "timed_out"):
            self.recovery_waits.labels(outcome)
        self.cancelled = Counter("strata:gateway_requests_cancelled",
                                 "Requests cancelled before their answer was whole, by reason "
                                 "(client_disconnect, deadline); the instances abort them too.",
                                 ["reason"], registry=reg)
        for reason in ("client_disconnect", "deadline"):
            self.cancelled.labels(reason)
        self.in_flight = Gauge("strata:gateway_requests_in_flight", "Requests admitted.",
                               registry=reg)
        self.queued = Gauge("strata:gateway_requests_queued", "Requests waiting for admission.",
                            registry=reg)
        self.routable = Gauge("strata:gateway_instances_routable", "Instances taking requests.",
                              registry=reg)
        self.response_cache = Gauge("strata:gateway_response_cache",
                                    "Response cache counters (hits, misses, stores, skipped, "
                                    "errors) since start.", ["event"], registry=reg)
        self.requests_by_endpoint = CountByLabel(self.requests)
        self.routed_by_instance = CountByLabel(self.routed)
        self.added_latency = Histogram("strata:gateway_added_latency_seconds",
                                       "Time the gateway adds to a request.",
                                       buckets=_OVERHEAD_BUCKETS_S, registry=reg)

    def render(self, refresh: Callable[[GatewayMetrics], None] | None = None) -> bytes:
        """The exposition text; `refresh` sets gauges first."""
        if refresh is not None:
            refresh(self)
        return generate_latest(self.registry)


__all__ = ["CountByLabel", "GatewayMetrics"]
