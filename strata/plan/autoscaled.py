"""The autoscaled architecture: the real scaling law (strata/autoscale/law.py) deciding over a
plan's fleet on its virtual clock, as the controller does over a live one. It is the only fleet
the law runs on outside a live one: `strata plan`'s autoscaled family (the real engines), and
the law's own stories and `bench/autoscale.py` (`run_autoscaled`: the capacity model's
instances, hours of traffic in seconds).

Every `interval_s` the law reads the fleet's signals (arrivals over its window and its recent
seconds, requests held at the gateway, in the engines' queues and in flight, TTFT p95 over its
window, KV use); an up starts instances that are ready `Costs.start_s` later, a down drains a
starting instance first, else the least busy (it takes no new request and stops when its last
one ends: nothing is lost). Cost is instance-seconds over the run.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.law import HOLD, Decision, LawState, ScalingLaw, Signals
from strata.plan.arch import Architecture
from strata.plan.costs import Costs
from strata.plan.fleet import Fleet, FleetResult
from strata.plan.instance import EngineShape
from strata.plan.workload import LengthDist, Slo, Workload, poisson_jobs
from strata.sim.profile import LatencyProfile


def autoscale(fleet: Fleet, slo: Slo) -> Autoscaler:
    """Hook the scaling law into `fleet` (before `fleet.run()`), its targets from `slo`."""
    w = fleet.workload
    config = AutoscaleConfig(
        min_replicas=1, max_replicas=fleet.arch.replicas, ttft_slo_s=slo.ttft_ms / 1000,
        itl_slo_s=slo.tpot_ms / 1000, prompt_tokens=max(1, round(w.prompt.mean + w.prefix_tokens)),
        output_tokens=max(1, round(w.output.mean)), max_num_seqs=fleet.shape.max_num_seqs,
        window_s=10.0, down_dwell_s=10.0, down_after_up_s=20.0)
    law = ScalingLaw(config, CapacityModel(fleet.profile, config.max_num_seqs, config.itl_slo_s))
    autoscaler = Autoscaler(fleet, law)
    autoscaler.attach()
    return autoscaler


@dataclass(frozen=True, slots=True)
class Tick:
    """The fleet at one decision."""

    t: float
    desired: int
    ready: int
    instances: int  # running, starting or draining: what is paid for
    queued: int  # held at the gateway


@dataclass(slots=True)
class AutoscaledRun:
    fleet: FleetResult
    decisions: list[tuple[float, Decision]] = field(default_factory=list)  # changes only
    ticks: list[Tick] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.fleet.turns)

    @property
    def num_served(self) -> int:
        return sum(1 for t in self.fleet.turns if t.finish_s is not None)

    @property
    def ttfts(self) -> list[tuple[float, float]]:
        """(arrival s, TTFT s) of every request that had its first token."""
        return [(t.arrival_s, t.first_token_s - t.arrival_s) for t in self.fleet.turns
                if t.first_token_s is not None]

    def ttft_p95_by_second(self) -> dict[int, float]:
        """TTFT p95 of the requests that arrived in each second."""
        by_second: dict[int, list[float]] = {}
        for arrived, ttft in self.ttfts:
            by_second.setdefault(int(arrived), []).append(ttft)
        return {t: sorted(v)[int(0.95 * (len(v) - 1))] for t, v in sorted(by_second.items())}

    def direction_changes(self, start_s: float = 0.0, end_s: float = math.inf) -> int:
        directions = [d.direction for t, d in self.decisions if start_s <= t < end_s]
        return sum(1 for a, b in zip(directions, directions[1:], strict=False) if a != b)


class Autoscaler:
    def __init__(self, fleet: Fleet, law: ScalingLaw) -> None:
        self.fleet, self.law, self.config = fleet, law, law.config
        self.state = LawState()
        self.desired = sum(1 for i in fleet.instances if i.view.role != "prefill")
        self.run = AutoscaledRun(fleet.result)
        self._arrivals: deque[float] = deque()
        self._ttfts: deque[tuple[float, float]] = deque()
        self._num_turns_seen = 0
        self._num_first_tokens_seen = 0

    def attach(self) -> None:
        self.fleet.on_tick = self.tick

    def tick(self) -> None:
        fleet = self.fleet
        if fleet.is_done():
            return
        decision = self.law.decide(self._signals(), self.state)
        if decision.direction != HOLD:
            self.run.decisions.append((fleet.now, decision))
            self._apply(decision.desired)
        live = [i for i in fleet.instances if i.stopped_at is None]
        self.run.ticks.append(Tick(fleet.now, self.desired,
                                   sum(1 for i in live if i.view.is_routable), len(live),
                                   len(fleet.held)))
        fleet.push(fleet.now + self.config.interval_s, "tick")

    def _signals(self) -> Signals:
        fleet, cfg, now = self.fleet, self.config, self.fleet.now
        turns, first_tokens = fleet.result.turns, fleet.first_tokens
        self._arrivals.extend(t.arrival_s for t in turns[self._num_turns_seen:])
        self._num_turns_seen = len(turns)
        self._ttfts.extend(first_tokens[self._num_first_tokens_seen:])
        self._num_first_tokens_seen = len(first_tokens)
        while self._arrivals and self._arrivals[0] < now - cfg.window_s:
            self._arrivals.popleft()
        while self._ttfts and self._ttfts[0][0] < now - cfg.ttft_window_s:
            self._ttfts.popleft()
        recent = sum(1 for a in self._arrivals if a >= now - cfg.recent_s)
        ttfts = sorted(ttft for _, ttft in self._ttfts)
        live = [i for i in fleet.instances if i.stopped_at is None]
        ready = [i for i in live if i.view.is_routable]
        stats = [i.stats() for i in ready]
        return Signals(
            now=now, desired=self.desired, ready=len(ready),
            arrival_rate=len(self._arrivals) / min(cfg.window_s, max(now, cfg.recent_s)),
            recent_rate=recent / cfg.recent_s, num_recent=recent, queued=len(fleet.held),
            waiting=sum(s.num_waiting for s in stats),
            in_flight=sum(i.view.num_in_flight for i in live),
            ttft_p95_s=ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
            kv_usage=sum(s.kv_usage for s in stats) / len(stats) if stats else 0.0)

    def _apply(self, desired: int) -> None:
        fleet = self.fleet
        live = [i for i in fleet.instances if i.stopped_at is None and not i.view.is_draining
                and i.view.role != "prefill"]
        for _ in range(desired - len(live)):
            fleet.add_instance(ready_s=fleet.costs.start_s)
        ordered = sorted(live, key=lambda i: (i.view.state == "ready", i.view.num_in_flight))
        for instance in ordered[:max(0, len(live) - desired)]:
            instance.view.is_draining = True  # a starting one first, else the least busy
            if not instance.has_work:
                instance.stopped_at = fleet.now
        self.desired = desired


def run_autoscaled(law: ScalingLaw, profile: LatencyProfile, rate: Callable[[float], float],
                   duration_s: float, *, start_s: float = 5.0, initial_replicas: int = 1,
                   seed: int = 0) -> AutoscaledRun:
    """`law` over a fleet of the capacity model's instances (modelled.py) for `duration_s` of
    Poisson arrivals at `rate(t)` requests/s, of the law's own request shape; the gateway holds
    what exceeds `max_num_seqs` per ready instance (as `strata up --autoscale` sets
    --instance-slots), and a new instance is ready `start_s` after the decision."""
    cfg = law.config
    prompt, output = LengthDist(cfg.prompt_tokens, cfg.prompt_tokens), \
        LengthDist(cfg.output_tokens, cfg.output_tokens)
    jobs = poisson_jobs(rate, duration_s, prompt_tokens=cfg.prompt_tokens,
                        output_tokens=cfg.output_tokens, rng=random.Random(seed))
    workload = Workload(num_requests=max(1, len(jobs)), rate_per_s=max(1e-9, len(jobs))
                        / duration_s, prompt=prompt, output=output, seed=seed)
    fleet = Fleet(Architecture("autoscaled", policy="least_load", autoscale=True,
                               replicas=max(1, cfg.max_replicas)),
                  profile, workload, shape=EngineShape(max_num_seqs=cfg.max_num_seqs),
                  costs=Costs(start_s=start_s), seed=seed, jobs=jobs, modelled=True,
                  instance_slots=cfg.max_num_seqs, initial_replicas=initial_replicas)
    autoscaler = Autoscaler(fleet, law)
    autoscaler.attach()
    fleet.run(until_s=duration_s)
    return autoscaler.run


def oracle_replicas(rate: float, law: ScalingLaw) -> int:
    """The fewest replicas that serve `rate` at the law's capacity, each fully used: the
    offline oracle knows the load of every second and pays for nothing more."""
    return math.ceil(rate / law.mu - 1e-9)


__all__ = ["AutoscaledRun", "Autoscaler", "Tick", "autoscale", "oracle_replicas",
           "run_autoscaled"]
