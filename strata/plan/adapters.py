"""LoRA adapters over a fleet, on a virtual clock: how many slots each instance needs and how
many instances (k) each adapter takes, for an adapter count and a Zipf popularity.

    AdapterWorkload   the fleet and the traffic: instances, adapters, Zipf exponent, slots per
                      instance, load time, service time, requests in flight per instance
    simulate()        one policy over it -> AdapterOutcome (cold loads, load spread, waits,
                      and each adapter's k at the end with `adapter_aware`)
    size_slots()      the smallest slot count whose cold loads stay under a bound

Each instance is a `strata.sim.adapters.AdapterSlots` (the real table's rules as a cost model)
serving requests concurrently for an exponential service time, and reporting its load and
residency every `report_s`, as a heartbeat does. The gateway's own parts route: its
`InstanceSet`, `RoutingPipeline` (filters over the adapter names the instances report) and a
policy of its table on the same virtual clock, so what is planned is what the gateway does
(bench/lora_placement.py compares policies with it).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from strata.clock import ManualClock
from strata.errors import ConfigError
from strata.gateway.routing.instances import (
    InFlight,
    InstanceSet,
    InstanceView,
    ReportedLoad,
    adapters_by_name,
)
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import AdapterAwarePolicy, RoutingPolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.sim.adapters import AdapterSlots


@dataclass(frozen=True, slots=True)
class AdapterWorkload:
    """The fleet and its traffic (see the module docstring)."""

    num_instances: int = 16
    num_adapters: int = 200
    zipf: float = 1.0
    num_slots: int = 8
    load_s: float = 0.1
    service_s: float = 1.0
    in_flight_per_instance: float = 8.0
    duration_s: float = 300.0
    report_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_instances", "num_adapters", "num_slots", "service_s",
                     "in_flight_per_instance", "duration_s", "report_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.zipf < 0 or self.load_s < 0:
            raise ConfigError("zipf and load_s must be >= 0")

    @property
    def names(self) -> tuple[str, ...]:
        """Adapter names by popularity rank (the first the most asked for)."""
        return tuple(f"lora-{i:03d}" for i in range(self.num_adapters))

    def requests(self) -> list[tuple[float, str]]:
        """Poisson arrivals at the rate that keeps `in_flight_per_instance` in flight; each
        request's adapter drawn by Zipf popularity."""
        rng = random.Random(self.seed)
        names = self.names
        weights = [1.0 / rank ** self.zipf for rank in range(1, len(names) + 1)]
        rate_per_s = self.in_flight_per_instance * self.num_instances / self.service_s
        now, out = 0.0, list[tuple[float, str]]()
        while True:
            now += rng.expovariate(rate_per_s)
            if now >= self.duration_s:
                return out
            out.append((now, rng.choices(names, weights)[0]))


@dataclass(slots=True)
class AdapterOutcome:
    """What one policy did with the workload."""

    policy: str
    num_requests: int
    num_loads: int
    served_ratio: float  # requests served per instance, max / mean
    in_flight_ratio: float  # requests in flight per instance averaged over time, max / mean
    wait_p50_ms: float  # what a request waited for its adapter (a load, a slot)
    wait_p99_ms: float
    replicas: dict[str, int] = field(default_factory=dict)  # k by adapter (adapter_aware)

    @property
    def loads_per_100(self) -> float:
        return 100.0 * self.num_loads / max(1, self.num_requests)


@dataclass(slots=True)
class _Instance:
    view: InstanceView
    slots: AdapterSlots
    waiting: list[tuple[RouteRequest, InFlight, float]] = field(default_factory=list)
    num_served: int = 0
    in_flight_area: float = 0.0  # integral of requests in flight over time
    changed_at: float = 0.0

    def account(self, now: float) -> None:
        self.in_flight_area += self.view.num_in_flight * (now - self.changed_at)
        self.changed_at = now

    def report(self) -> None:
        self.view.reported = ReportedLoad(num_running=self.view.num_in_flight,
                                          adapters=adapters_by_name(self.slots.residency()))


class _Run:
    """The discrete-event loop of one `simulate` call."""

    def __init__(self, workload: AdapterWorkload, policy: RoutingPolicy,
                 clock: ManualClock) -> None:
        self.workload = workload
        self.clock = clock
        self.rng = random.Random(workload.seed + 1)
        self.fleet = {f"i{k:02d}": _Instance(
            InstanceView(f"i{k:02d}", f"sim://i{k:02d}", "base"),
            AdapterSlots(workload.num_slots, workload.load_s, workload.names))
            for k in range(workload.num_instances)}
        self.pipeline = RoutingPipeline(InstanceSet(i.view for i in self.fleet.values()),
                                        policy)
        self.events: list[tuple[float, int, _Instance | None, object]] = []
        self.seq = itertools.count()
        self.waits_s: list[float] = []

    def run(self, requests: Sequence[tuple[float, str]]) -> None:
        for at, adapter in requests:
            heapq.heappush(self.events, (at, next(self.seq), None, adapter))
        report_at = 0.0
        while self.events:
            at, _, instance, payload = heapq.heappop(self.events)
            while report_at <= at:  # heartbeats
                self.clock.set(max(self.clock.now, report_at))
                for each in self.fleet.values():
                    each.report()
                report_at += self.workload.report_s
            self.clock.set(at)
            if instance is None:
                self._arrive(str(payload))
            else:
                self._finish(instance, *payload)  # type: ignore[misc]

    def _arrive(self, adapter: str) -> None:
        request = RouteRequest(model=adapter, num_tokens=256)
        decision = self.pipeline.route(request)
        if decision.instance is None:
            raise AssertionError(f"no instance for {adapter}: {decision.reason}")
        instance = self.fleet[decision.instance.instance_id]
        instance.account(self.clock.now)
        self._start(instance, request, self.pipeline.sent(request, instance.view),
                    self.clock.now)

    def _start(self, instance: _Instance, request: RouteRequest, in_flight: InFlight,
               arrived: float) -> None:
        ready_at = instance.slots.start(request.model or "", self.clock.now)
        if ready_at is None:  # every slot held: wait for a release
            instance.waiting.append((request, in_flight, arrived))
            return
        self.waits_s.append(ready_at - arrived)
        done = ready_at + self.rng.expovariate(1.0 / self.workload.service_s)
        heapq.heappush(self.events, (done, next(self.seq), instance, (request, in_flight)))

    def _finish(self, instance: _Instance, request: RouteRequest, in_flight: InFlight) -> None:
        instance.account(self.clock.now)
        instance.slots.release(request.model or "")
        instance.num_served += 1
        self.pipeline.ended(request, in_flight, is_success=True)
        waiting, instance.waiting = instance.waiting, []
        for held in waiting:
            self._start(instance, *held)


def simulate(workload: AdapterWorkload, policy: RoutingPolicy,
             clock: ManualClock | None = None) -> AdapterOutcome:
    """`policy` (built on `clock`, the run's virtual clock) over `workload`."""
    run = _Run(workload, policy, clock if clock is not None else ManualClock())
    requests = workload.requests()
    run.run(requests)
    served = [i.num_served for i in run.fleet.values()]
    for instance in run.fleet.values():
        instance.account(run.clock.now)
    areas = [i.in_flight_area for i in run.fleet.values()]
    waits = sorted(run.waits_s) or [0.0]
    replicas = {} if not isinstance(policy, AdapterAwarePolicy) else {
        name: policy.demand.replicas(name, workload.num_instances) for name in workload.names}
    return AdapterOutcome(policy.name, len(requests),
                          sum(i.slots.num_loads for i in run.fleet.values()),
                          max(served) / max(1e-9, statistics.mean(served)),
                          max(areas) / max(1e-9, statistics.mean(areas)),
                          1000 * waits[len(waits) // 2], 1000 * waits[int(len(waits) * 0.99)],
                          replicas)


def size_slots(workload: AdapterWorkload, *, max_loads_per_100: float,
               max_wait_p99_ms: float = 1000.0,
               slot_choices: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
               ) -> tuple[list[tuple[int, AdapterOutcome]], int | None]:
    """`adapter_aware` at each slot count (up to the adapter count), and the smallest whose
    cold loads per 100 requests are at most `max_loads_per_100` and whose requests wait for
    their adapter at most `max_wait_p99_ms` at p99 (None: none is). Both bounds: too few slots
    can show few loads only because requests queue for a slot behind held adapters."""
    rows = []
    for num_slots in sorted({min(s, workload.num_adapters) for s in slot_choices}):
        clock = ManualClock()
        policy = create_policy("adapter_aware", clock=clock)
        rows.append((num_slots, simulate(replace(workload, num_slots=num_slots), policy,
                                         clock)))
    chosen = next((n for n, outcome in rows if outcome.loads_per_100 <= max_loads_per_100
                   and outcome.wait_p99_ms <= max_wait_p99_ms), None)
    return rows, chosen




def format_slot_plan(workload: AdapterWorkload, rows: Sequence[tuple[int, AdapterOutcome]],
                     chosen: int | None, max_loads_per_100: float,
                     max_wait_p99_ms: float) -> str:
    """The table of `size_slots`, the slot count chosen and k by popularity rank."""
    lines = [f"LoRA adapters: {workload.num_adapters} by Zipf({workload.zipf}) over "
             f"{workload.num_instances} instances, {workload.in_flight_per_instance:g} requests "
             f"in flight each, a load {1000 * workload.load_s:.0f} ms "
             f"(simulated, adapter_aware, {workload.duration_s:.0f} s)",
             f"{'slots':>5} {'cold loads /100 req':>20} {'wait p99 ms':>12} "
             f"{'served max/mean':>16}"]
    lines += [f"{n:>5} {o.loads_per_100:>20.1f} {o.wait_p99_ms:>12.0f} {o.served_ratio:>16.2f}"
              for n, o in rows]
    if chosen is None:
        lines.append(f"no slot count keeps cold loads at {max_loads_per_100:g} per 100 "
                     f"requests and the wait p99 at {max_wait_p99_ms:g} ms: more instances, or "
                     "fewer adapters per base model")
        return "\n".join(lines)
    lines.append(f"chosen: --max-cpu-loras {chosen} (cold loads at most {max_loads_per_100:g} "
                 f"per 100 requests, wait p99 at most {max_wait_p99_ms:g} ms)")
    replicas = dict(rows)[chosen].replicas
    lines.append("k (instances an adapter is placed on) by popularity rank: " + ranks_of(
        [replicas.get(name, 1) for name in workload.names]))
    return "\n".join(lines)


def ranks_of(replicas: Sequence[int]) -> str:
    """"1: 6, 2: 3, 3-10: 2, 11-200: 1": runs of equal k by rank."""
    parts, start = [], 0
    for rank in range(1, len(replicas) + 1):
        if rank == len(replicas) or replicas[rank] != replicas[start]:
            span = f"{start + 1}" if rank == start + 1 else f"{start + 1}-{rank}"
            parts.append(f"{span}: {replicas[start]}")
            start = rank
    return ", ".join(parts)


__all__ = ["AdapterOutcome", "AdapterWorkload", "format_slot_plan", "ranks_of", "simulate",
           "size_slots"]
