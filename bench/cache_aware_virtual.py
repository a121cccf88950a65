"""Where cache-aware routing loses hits: the shared-prefix workload of bench/cache_aware.py on a
virtual clock (strata.plan's fleet: the real engines, prefix caches and routing policies), with
every request's miss put in one class.

    .venv/bin/python bench/cache_aware_virtual.py                 # every policy, 8 instances
    .venv/bin/python bench/cache_aware_virtual.py --policies cache_aware --tenants-shown 10

Workload as bench/cache_aware.py's sim fleet: 50 tenants, 1,000-token prefixes, Zipf(1.0), a
unique 40-token question each, 16 output tokens, 600 requests, 24 at a time, 1,300 KV blocks an
instance (0.45 GB of SmolLM2). Runs in seconds and is deterministic, so a policy change can be
read at once; the live benchmark then confirms it.

A request's prefix (its tenant's first prefix tokens) is a *hit* when the engine reused all of it
(the engine recomputes at least one token, so a fully cached prefix counts whole blocks); else:

    first    the tenant's first request: the oracle misses it too
    spill    the tenant's first request on this instance (its home set grew)
    evicted  the tenant was served here before, the blocks are gone
    partial  some of the prefix was reused

Load spread: each instance's requests in flight, averaged over time; max / mean.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict
from typing import Any

from strata.plan.arch import Architecture
from strata.plan.fleet import Fleet
from strata.plan.instance import EngineShape
from strata.plan.workload import LengthDist, Workload
from strata.sim.profile import load_profile

POLICIES = ("round_robin", "power_of_two", "least_load", "cache_aware")
CLASSES = ("hit", "first", "spill", "evicted", "partial")


class Recorder:
    """Wraps a fleet's gateway: which tenant went where, and each instance's in-flight time."""

    def __init__(self, fleet: Fleet, prefix_tokens: int) -> None:
        self.fleet, self.prefix_tokens = fleet, prefix_tokens
        self.tenant_of = {id(p): t for t, p in enumerate(_prefixes(fleet))}
        self.served: set[tuple[int, str]] = set()
        self.seen: set[int] = set()
        self.rows: list[dict[str, Any]] = []
        self.area: dict[str, float] = defaultdict(float)
        self.last_s = 0.0
        self.job: Any = None
        self.spills: list[tuple[int, int, dict[str, list[int]]]] = []
        self.inflight: dict[str, list[int]] = defaultdict(list)
        self.route_of: dict[int, int] = {}
        route, finished = fleet.gateway.route, fleet.gateway.finished
        arrive = fleet._on_arrive

        def arrived(payload: Any) -> None:
            self.job = payload[0]
            arrive(payload)

        def routed(candidates: Any, request: Any, session_id: Any) -> Any:
            self.advance()
            homes = {i.instance_id: sorted(self.inflight[i.instance_id])
                     for i in candidates if (self.tenant(), i.instance_id) in self.served}
            instance, r = route(candidates, request, session_id)
            self._classify(request, instance.instance_id)
            self.inflight[instance.instance_id].append(self.tenant())
            self.route_of[id(r)] = self.tenant()
            if self.rows[-1]["kind"] == "spill":
                total = sum(i.view.request_load for i in candidates) - 1
                self.spills.append((self.tenant(), total, homes))
            return instance, r

        def done(view: Any, r: Any, blocks: Any) -> None:
            self.advance()
            self.inflight[view.instance_id].remove(self.route_of.pop(id(r)))
            finished(view, r, blocks)

        fleet._on_arrive = arrived  # type: ignore[method-assign]
        fleet.gateway.route = routed  # type: ignore[method-assign]
        fleet.gateway.finished = done  # type: ignore[method-assign]

    def advance(self) -> None:
        dt = self.fleet.now - self.last_s
        for instance in self.fleet.instances:
            self.area[instance.instance_id] += dt * instance.view.num_in_flight
        self.last_s = self.fleet.now

    def tenant(self) -> int:
        return self.tenant_of[id(self.job.prefix_token_ids)]

    def _classify(self, request: Any, instance_id: str) -> None:
        tenant = self.tenant()
        key = (tenant, instance_id)
        kind = "first" if tenant not in self.seen else "spill" if key not in self.served else None
        self.seen.add(tenant)
        self.served.add(key)
        self.rows.append({"tenant": tenant, "instance": instance_id, "kind": kind,
                          "request": request})

    def classes(self) -> list[str]:
        usable = (self.prefix_tokens // 16) * 16
        out = []
        for row in self.rows:
            cached = min(row["request"].num_cached_tokens, usable)
            out.append(row["kind"] or ("hit" if cached >= usable else
                                       "evicted" if cached == 0 else "partial"))
        return out


def _prefixes(fleet: Fleet) -> list[list[int]]:
    unique: dict[int, list[int]] = {}
    for job in fleet.jobs:
        unique.setdefault(id(job.prefix_token_ids), job.prefix_token_ids)
    return list(unique.values())


def run(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(num_requests=args.requests, concurrency=args.concurrency,
                        prompt=LengthDist(args.question_tokens, args.question_tokens),
                        output=LengthDist(16, 16), prefix_tokens=args.prefix_tokens,
                        num_prefixes=args.tenants, zipf_s=args.zipf, seed=args.seed)
    fleet = Fleet(Architecture("replicas", replicas=args.instances, policy=policy),
                  load_profile("smollm2-cpu"), workload, shape=EngineShape(kv_blocks=args.blocks))
    recorder = Recorder(fleet, args.prefix_tokens)
    result = fleet.run()
    recorder.advance()
    kinds = recorder.classes()
    cached = sum(t.num_cached_tokens for t in result.turns)
    prompt = sum(t.num_prompt_tokens for t in result.turns)
    ttfts = sorted((t.first_token_s or 0) - t.arrival_s for t in result.turns)
    areas = list(recorder.area.values())
    per_tenant: dict[int, Counter[str]] = defaultdict(Counter)
    homes: dict[int, set[str]] = defaultdict(set)
    for row, kind in zip(recorder.rows, kinds, strict=True):
        per_tenant[row["tenant"]][kind] += 1
        homes[row["tenant"]].add(row["instance"])
    return {"policy": policy, "hit_rate": cached / prompt, "classes": Counter(kinds),
            "spread": max(areas) / statistics.fmean(areas),
            "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3,
            "ttft_p99_ms": ttfts[int(len(ttfts) * 0.99)] * 1e3,
            "per_tenant": per_tenant, "homes": homes, "spills": recorder.spills}


def oracle(args: argparse.Namespace) -> float:
    """One infinite cache seeing the requests in order (whole blocks, one token recomputed)."""
    fleet = Fleet(Architecture("replicas", replicas=1),
                  load_profile("smollm2-cpu"), Workload(
                      num_requests=args.requests, concurrency=args.concurrency,
                      prompt=LengthDist(args.question_tokens, args.question_tokens),
                      prefix_tokens=args.prefix_tokens, num_prefixes=args.tenants,
                      zipf_s=args.zipf, seed=args.seed))
    seen: set[int] = set()
    hit = total = 0
    for job in fleet.jobs:
        prompt = job.prefix_token_ids + job.turns[0].user_token_ids
        total += len(prompt)
        if id(job.prefix_token_ids) in seen:
            hit += (min(len(job.prefix_token_ids), len(prompt) - 1) // 16) * 16
        seen.add(id(job.prefix_token_ids))
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=1300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tenants-shown", type=int, default=0)
    ap.add_argument("--show-spills", action="store_true")
    args = ap.parse_args()
    best = oracle(args)
    print(f"oracle hit rate {best:.3f}")
    print("| policy | hit rate | of oracle | in flight max/mean | TTFT p50 ms | TTFT p99 ms | "
          + " | ".join(CLASSES) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(CLASSES))
    for policy in args.policies:
        r = run(policy, args)
        print(f"| {policy} | {r['hit_rate']:.3f} | {r['hit_rate'] / best:.0%} | "
              f"{r['spread']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              + " | ".join(str(r["classes"][c]) for c in CLASSES) + " |")
        if args.show_spills:
            for tenant, total, homes in r["spills"]:
                print(f"    spill of tenant {tenant}: {total} in flight; tenants in flight at "
                      f"its homes {homes}")
        for tenant in sorted(r["per_tenant"])[:args.tenants_shown]:
            counts = r["per_tenant"][tenant]
            print(f"    tenant {tenant}: {sum(counts.values())} requests on "
                  f"{len(r['homes'][tenant])} instances; "
                  + ", ".join(f"{c} {counts[c]}" for c in CLASSES if counts[c]))


if __name__ == "__main__":
    main()
