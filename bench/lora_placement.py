"""LoRA adapter placement on a simulated fleet (issue 26): cold loads and load spread of the
gateway's `adapter_aware` against `least_load` and against route-to-loaded, on a virtual clock.

    .venv/bin/python bench/lora_placement.py                       # 16 instances, 200 adapters
    .venv/bin/python bench/lora_placement.py --slots 4 --load-s 1.0 --zipf 1.2

The fleet and its traffic are strata/plan/adapters.py's (what `strata plan --adapters` sizes
with): `--instances` simulated instances with `--slots` adapter slots each (LRU, a held adapter
never evicted, loads one at a time of `--load-s`), requests of an exponential service time (mean
`--service-s`) running concurrently, Poisson arrivals keeping `--load` requests in flight per
instance on average, each for one of `--adapters` adapters by Zipf(`--zipf`) popularity; each
instance reports its load and residency every second (its heartbeat). The gateway's own
`InstanceSet`, `RoutingPipeline` and policies route; route-to-loaded is the baseline defined
here (the least loaded instance that reports the adapter resident, else the least loaded).
Measured per policy:

    cold       loads (a request whose adapter was not resident), and per 100 requests
    spread     requests served per instance, max / mean; and requests in flight per instance
               averaged over time, max / mean
    wait       what a request waited for its adapter (its load, or a slot): p50, p99
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from strata.clock import ManualClock
from strata.gateway.config import AdapterPlacementConfig, GatewayConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import RoutingPolicy, StatelessPolicy, create_policy
from strata.gateway.routing.policies.base import RouteRequest
from strata.plan.adapters import AdapterWorkload, simulate

POLICIES = ("adapter_aware", "least_load", "route_to_loaded")


class RouteToLoadedPolicy(StatelessPolicy):
    """The baseline: the least loaded instance that reports the adapter resident, else the
    least loaded (what a router that reads residency and nothing else does)."""

    name = "route_to_loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        model = request.model or ""
        loaded = [view for view in candidates if view.is_resident(model)]
        return min(loaded or candidates, key=lambda view: view.load_key)


def policy_for(name: str, spread: float, clock: ManualClock) -> RoutingPolicy:
    if name == "route_to_loaded":
        return RouteToLoadedPolicy()
    config = GatewayConfig(adapters=AdapterPlacementConfig(spread=spread))
    return create_policy(name, config=config, rng=random.Random(1), clock=clock)


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
    p.add_argument("--spread", type=float, default=2.0, help="adapter_aware's --adapter-spread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = p.parse_args()
    workload = AdapterWorkload(args.instances, args.adapters, args.zipf, args.slots, args.load_s,
                               args.service_s, args.load, args.duration_s, seed=args.seed)
    print(f"{args.instances} instances x {args.slots} slots, {args.adapters} adapters "
          f"Zipf({args.zipf}), load {args.load}/instance, {len(workload.requests())} requests "
          f"over {args.duration_s:.0f} s, load {args.load_s * 1000:.0f} ms, seed {args.seed}")
    print(f"{'policy':16} {'cold loads':>10} {'/100 req':>9} {'served max/mean':>16} "
          f"{'in-flight max/mean':>19} {'wait p50 ms':>12} {'p99 ms':>8}")
    results = {}
    for name in args.policies:
        clock = ManualClock()
        results[name] = r = simulate(workload, policy_for(name, args.spread, clock), clock)
        print(f"{name:16} {r.num_loads:>10} {r.loads_per_100:>9.1f} {r.served_ratio:>16.2f} "
              f"{r.in_flight_ratio:>19.2f} {r.wait_p50_ms:>12.0f} {r.wait_p99_ms:>8.0f}",
              flush=True)
    if "adapter_aware" in results and "least_load" in results:
        cut = 1 - results["adapter_aware"].num_loads / results["least_load"].num_loads
        print(f"adapter_aware: {100 * cut:.0f} % fewer cold loads than least_load")


if __name__ == "__main__":
    main()
