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
    """One adapter summed over the routable instances that know it."""

    num_instances: int = 0
    num_resident: int = 0
    num_loads: int = 0
    num_evictions: int = 0
    load_s_sum: float = 0.0
    num_timed: int = 0


def fleet_adapters(instances: InstanceSet) -> dict[str, FleetAdapter]:
    """Every adapter some routable instance knows, by name, summed over those instances."""
    out: dict[str, FleetAdapter] = {}
    for view in instances.snapshot():
        if not view.is_routable:
            continue
        for name, residency in view.reported.adapters.items():
            row = out.setdefault(name, FleetAdapter())
            row.num_instances += 1
            row.num_resident += residency.is_resident
            row.num_loads += residency.num_loads
            row.num_evictions += residency.num_evictions
            if residency.load_s > 0:
                row.load_s_sum += residency.load_s
                row.num_timed += 1
    return out


class AdapterMetrics(Collector):
    """The series of the module docstring, computed at each scrape."""

    def __init__(self, registry: CollectorRegistry, policy: AdapterAwarePolicy,
                 instances: InstanceSet) -> None:
        self.policy = policy
        self.instances = instances
        registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = sorted(fleet_adapters(self.instances).items())
        labels = ["adapter"]
        gauges = {
            "replicas": GaugeMetricFamily("strata:gateway_adapter_replicas",
                                          "Instances in the adapter's home set now (k).",
                                          labels=labels),
            "share": GaugeMetricFamily("strata:gateway_adapter_share",
                                       "The adapter's share of this gateway's recent requests.",
                                       labels=labels),
            "resident": GaugeMetricFamily("strata:gateway_adapter_resident_instances",
                                          "Instances that report the adapter resident.",
                                          labels=labels),
            "load_s": GaugeMetricFamily("strata:gateway_adapter_load_seconds",
                                        "The instances' last load time of the adapter, "
                                        "averaged.", labels=labels)}
        loads = CounterMetricFamily("strata:gateway_adapter_loads",
                                    "Loads of the adapter, summed over the instances.",
                                    labels=labels)
        evictions = CounterMetricFamily("strata:gateway_adapter_evictions",
                                        "Evictions of the adapter, summed over the instances.",
                                        labels=labels)
        demand = self.policy.demand
        for name, row in rows:
            gauges["replicas"].add_metric([name], demand.replicas(name, row.num_instances))
            gauges["share"].add_metric([name], demand.share(name))
            gauges["resident"].add_metric([name], row.num_resident)
            gauges["load_s"].add_metric([name], row.load_s_sum / row.num_timed
                                        if row.num_timed else 0.0)
            loads.add_metric([name], row.num_loads)
            evictions.add_metric([name], row.num_evictions)
        yield from gauges.values()
        yield loads
        yield evictions

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


__all__ = ["AdapterMetrics", "FleetAdapter", "fleet_adapters"]
