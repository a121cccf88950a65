"""LoRA adapter placement on a simulated fleet (issue 26): cold loads and load spread of the
gateway's `adapter_aware` against `least_load` and against route-to-loaded, on a virtual clock.

    .venv/bin/python bench/lora_placement.py                       # 16 instances, 200 adapters
    .venv/bin/python bench/lora_placement.py --slots 4 --load-s 1.0 --zipf 1.2

The fleet: `--instances` simulated instances, each with `--slots` adapter slots
(strata/sim/adapters.py: LRU, a held adapter is never evicted, loads one at a time of `--load-s`
each), every request of an exponential service time (mean `--service-s`), running concurrently.
The workload: Poisson arrivals at `--load` requests in flight per instance on average, each for
one of `--adapters` adapters drawn by Zipf(`--zipf`) popularity. Each instance reports its load
and residency every `--report-s` (its heartbeat), as a real one does.

The gateway's own parts route: its `InstanceSet` (in-flight accounting), `RoutingPipeline`
(filters: the adapter names the instances report) and the policy from its table, on the virtual
clock; route-to-loaded is the baseline defined here (the least loaded instance that reports the
adapter resident, else the least loaded). Measured per policy:

    cold       loads (a request whose adapter was not resident), and per 100 requests
    spread     requests served per instance, max / mean; and requests in flight per instance
               averaged over time, max / mean
    wait       what a request waited for its adapter (its load, or a slot): p50, p99
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from strata.clock import ManualClock
from strata.gateway.config import AdapterPlacementConfig, GatewayConfig
from strata.gateway.routing.instances import (
    InFlight,
    InstanceSet,
    InstanceView,
    ReportedLoad,
    adapters_by_name,
)
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import RoutingPolicy, StatelessPolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.sim.adapters import AdapterSlots

POLICIES = ("adapter_aware", "least_load", "route_to_loaded")


class RouteToLoadedPolicy(StatelessPolicy):
    """The baseline: the least loaded instance that reports the adapter resident, else the
    least loaded (what a router that reads residency and nothing else does)."""

    name = "route_to_loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        model = request.model or ""
        loaded = [view for view in candidates if view.is_resident(model)]
        return min(loaded or candidates, key=lambda view: view.load_key)


@dataclass(slots=True)
class SimInstance:
    view: InstanceView
    slots: AdapterSlots
    waiting: list[tuple[RouteRequest, InFlight, float]] = field(default_factory=list)
    num_served: int = 0
    in_flight_area: float = 0.0  # integral of requests in flight over time
    changed_at: float = 0.0

    def account(self, now: float) -> None:
        self.in_flight_area += self.view.num_in_flight * (now - self.changed_at)
        self.changed_at = now


@dataclass(slots=True)
class Result:
    policy: str
    num_requests: int
    num_loads: int
    served_ratio: float
    in_flight_ratio: float
    wait_p50_ms: float
    wait_p99_ms: float


class FleetRun:
    """One policy over one workload (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        self.args = args
        self.clock = ManualClock()
        self.rng = random.Random(args.seed)
        names = tuple(f"lora-{i:03d}" for i in range(args.adapters))
        self.sims = {f"i{k:02d}": SimInstance(
            InstanceView(f"i{k:02d}", f"sim://i{k:02d}", "base"),
            AdapterSlots(args.slots, args.load_s, names)) for k in range(args.instances)}
        self.instances = InstanceSet(sim.view for sim in self.sims.values())
        self.pipeline = RoutingPipeline(self.instances, self._policy(policy))
        self.policy = policy
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.waits_s: list[float] = []
        self.num_requests = 0
        for sim in self.sims.values():
            self._report(sim)

    def _policy(self, name: str) -> RoutingPolicy:
        if name == "route_to_loaded":
            return RouteToLoadedPolicy()
        config = GatewayConfig(adapters=AdapterPlacementConfig(spread=self.args.spread))
        return create_policy(name, config=config, rng=random.Random(1), clock=self.clock)

    def push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def run(self, requests: Sequence[tuple[float, str]]) -> Result:
        for at, adapter in requests:
            self.push(at, "arrive", adapter)
        report_at = 0.0
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            while report_at <= at:  # heartbeats, on the virtual clock
                self.clock.set(max(self.clock.now, report_at))
                for sim in self.sims.values():
                    self._report(sim)
                report_at += self.args.report_s
            self.clock.set(at)
            if kind == "arrive":
                self._arrive(str(payload))
            else:
                self._finish(*payload)  # type: ignore[misc]
        return self._result()

    def _report(self, sim: SimInstance) -> None:
        sim.view.reported = ReportedLoad(num_running=sim.view.num_in_flight,
                                         adapters=adapters_by_name(sim.slots.residency()))

    def _arrive(self, adapter: str) -> None:
        self.num_requests += 1
        request = RouteRequest(model=adapter, num_tokens=256)
        decision = self.pipeline.route(request)
        assert decision.instance is not None, decision.reason
        sim = self.sims[decision.instance.instance_id]
        sim.account(self.clock.now)
        in_flight = self.pipeline.sent(request, sim.view)
        self._start(sim, request, in_flight, self.clock.now)

    def _start(self, sim: SimInstance, request: RouteRequest, in_flight: InFlight,
               arrived: float) -> None:
        adapter = request.model or ""
        ready_at = sim.slots.start(adapter, self.clock.now)
        if ready_at is None:  # every slot held: wait for a release
            sim.waiting.append((request, in_flight, arrived))
            return
        self.waits_s.append(ready_at - arrived)
        done = ready_at + self.rng.expovariate(1.0 / self.args.service_s)
        self.push(done, "finish", (sim, request, in_flight))

    def _finish(self, sim: SimInstance, request: RouteRequest, in_flight: InFlight) -> None:
        sim.account(self.clock.now)
        sim.slots.release(request.model or "")
        sim.num_served += 1
        self.pipeline.ended(request, in_flight, is_success=True)
        waiting, sim.waiting = sim.waiting, []
        for held in waiting:
            self._start(sim, *held)

    def _result(self) -> Result:
        end = self.clock.now
        served = [sim.num_served for sim in self.sims.values()]
        areas = []
        for sim in self.sims.values():
            sim.account(end)
            areas.append(sim.in_flight_area)
        waits = sorted(self.waits_s)
        return Result(self.policy, self.num_requests,
                      sum(sim.slots.num_loads for sim in self.sims.values()),
                      max(served) / statistics.mean(served), max(areas) / statistics.mean(areas),
                      1000 * waits[len(waits) // 2], 1000 * waits[int(len(waits) * 0.99)])


def workload(args: argparse.Namespace) -> list[tuple[float, str]]:
    """Poisson arrivals; each request's adapter by Zipf popularity (rank 1 the most asked)."""
    rng = random.Random(args.seed)
    weights = [1.0 / (rank ** args.zipf) for rank in range(1, args.adapters + 1)]
    rate_per_s = args.load * args.instances / args.service_s
    now, out = 0.0, []
    names = [f"lora-{i:03d}" for i in range(args.adapters)]
    while now < args.duration_s:
        now += rng.expovariate(rate_per_s)
        out.append((now, rng.choices(names, weights)[0]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--load-s", type=float, default=0.1)
    p.add_argument("--service-s", type=float, default=1.0)
    p.add_argument("--load", type=float, default=8.0, help="requests in flight per instance")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--report-s", type=float, default=1.0)
    p.add_argument("--spread", type=float, default=2.0, help="adapter_aware's --adapter-spread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = p.parse_args()
    requests = workload(args)
    print(f"{args.instances} instances x {args.slots} slots, {args.adapters} adapters "
          f"Zipf({args.zipf}), load {args.load}/instance, {len(requests)} requests over "
          f"{args.duration_s:.0f} s, load {args.load_s * 1000:.0f} ms, seed {args.seed}")
    print(f"{'policy':16} {'cold loads':>10} {'/100 req':>9} {'served max/mean':>16} "
          f"{'in-flight max/mean':>19} {'wait p50 ms':>12} {'p99 ms':>8}")
    results = {name: FleetRun(args, name).run(requests) for name in args.policies}
    for r in results.values():
        print(f"{r.policy:16} {r.num_loads:>10} {100 * r.num_loads / r.num_requests:>9.1f} "
              f"{r.served_ratio:>16.2f} {r.in_flight_ratio:>19.2f} {r.wait_p50_ms:>12.0f} "
              f"{r.wait_p99_ms:>8.0f}")
    if "adapter_aware" in results and "least_load" in results:
        cut = 1 - results["adapter_aware"].num_loads / results["least_load"].num_loads
        print(f"adapter_aware: {100 * cut:.0f} % fewer cold loads than least_load")


if __name__ == "__main__":
    main()
