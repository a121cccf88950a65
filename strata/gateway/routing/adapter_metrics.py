"""The fleet's LoRA adapters on the gateway's /metrics (with `--policy adapter_aware`), read at
each scrape from the instances' load reports (strata/protocol/lora.py) and the policy's demand:

    strata:gateway_adapter_replicas{adapter}            k: the instances its home set spans now
    strata:gateway_adapter_share{adapter}               its share of this gateway's requests
    strata:gateway_adapter_resident_instances{adapter}  instances that report it resident
    strata:gateway_adapter_loads_total{adapter}         loads, summed over the instances
    strata:gateway_adapter_evictions_total{adapter}     evictions, summed over the instances
    strata:gateway_adapter_load_seconds{adapter}        the instances' last load time, averaged

The sums are the instances' counts since each started (an instance that restarts or leaves
takes its counts along: Prometheus reads the drop as a counter reset). One series per adapter
the fleet knows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.policies.adapter_aware import AdapterAwarePolicy


@dataclass(slots=True)
class FleetAdapter:
    """One adapter summed over the routable instances that know it, with its k and share."""

    name: str
    num_instances: int = 0
    num_resident: int = 0
    num_loads: int = 0
    num_evictions: int = 0
    load_s_sum: float = 0.0
    num_timed: int = 0
    replicas: int = 1
    share: float = 0.0

    @property
    def load_s(self) -> float:
        """The instances' last load times, averaged (0: none loaded it yet)."""
        return self.load_s_sum / self.num_timed if self.num_timed else 0.0

    def to_json(self) -> dict[str, object]:
        return {"adapter": self.name, "replicas": self.replicas, "share": round(self.share, 4),
                "num_instances": self.num_instances, "num_resident": self.num_resident,
                "num_loads": self.num_loads, "num_evictions": self.num_evictions,
                "load_s": round(self.load_s, 4)}


def fleet_adapters(instances: InstanceSet, policy: AdapterAwarePolicy) -> list[FleetAdapter]:
    """Every adapter some routable instance knows, by name, summed over those instances."""
    out: dict[str, FleetAdapter] = {}
    for view in instances.snapshot():
        if not view.is_routable:
            continue
        for name, residency in view.reported.adapters.items():
            row = out.get(name) or out.setdefault(name, FleetAdapter(name))
            row.num_instances += 1
            row.num_resident += residency.is_resident
            row.num_loads += residency.num_loads
            row.num_evictions += residency.num_evictions
            if residency.load_s > 0:
                row.load_s_sum += residency.load_s
                row.num_timed += 1
    for row in out.values():
        row.replicas = policy.demand.replicas(row.name, row.num_instances)
        row.share = policy.demand.share(row.name)
    return [out[name] for name in sorted(out)]


class AdapterMetrics(Collector):
    """The series of the module docstring, computed at each scrape; `rows()` for the
    dashboard."""

    def __init__(self, registry: CollectorRegistry, policy: AdapterAwarePolicy,
                 instances: InstanceSet) -> None:
        self.policy = policy
        self.instances = instances
        registry.register(self)

    def rows(self) -> list[FleetAdapter]:
        return fleet_adapters(self.instances, self.policy)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["adapter"]
        gauges = {
            "replicas": GaugeMetricFamily("strata:gateway_adapter_replicas",
                                          "Instances in the adapter's home set now (k).",
                                          labels=labels),
            "share": GaugeMetricFamily("strata:gateway_adapter_share",
                                       "The adapter's share of this gateway's recent requests.",
                                       labels=labels),
            "num_resident": GaugeMetricFamily("strata:gateway_adapter_resident_instances",
                                              "Instances that report the adapter resident.",
                                              labels=labels),
            "load_s": GaugeMetricFamily("strata:gateway_adapter_load_seconds",
                                        "The instances' last load time of the adapter, "
                                        "averaged.", labels=labels)}
        counters = {
            "num_loads": CounterMetricFamily("strata:gateway_adapter_loads",
                                             "Loads of the adapter, summed over the instances.",
                                             labels=labels),
            "num_evictions": CounterMetricFamily("strata:gateway_adapter_evictions",
                                                 "Evictions of the adapter, summed over the "
                                                 "instances.", labels=labels)}
        for row in self.rows():
            for field_name, gauge in gauges.items():
                gauge.add_metric([row.name], getattr(row, field_name))
            for field_name, counter in counters.items():
                counter.add_metric([row.name], getattr(row, field_name))
        yield from gauges.values()
        yield from counters.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


__all__ = ["AdapterMetrics", "FleetAdapter", "fleet_adapters"]
