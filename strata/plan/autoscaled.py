"""The autoscaled architecture: the real scaling law (strata/autoscale/law.py) deciding over a
plan's fleet on its virtual clock, as the controller does over a live one.

Every `interval_s` the law reads the fleet's signals (arrivals over its window, requests in
flight, TTFT p95 over its window, the engines' queues); an up starts instances that are ready
`Costs.start_s` later, a down drains the least busy instance (it takes no new request and
stops when its last one ends). Cost is instance-seconds over the run.
"""

from __future__ import annotations

from collections import deque

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.law import HOLD, LawState, ScalingLaw, Signals
from strata.plan.fleet import Fleet
from strata.plan.workload import Slo


def autoscale(fleet: Fleet, slo: Slo) -> None:
    """Hook the scaling law into `fleet` (before `fleet.run()`)."""
    Autoscaler(fleet, slo).attach()


class Autoscaler:
    def __init__(self, fleet: Fleet, slo: Slo) -> None:
        w = fleet.workload
        self.fleet = fleet
        self.config = AutoscaleConfig(
            min_replicas=1, max_replicas=fleet.arch.replicas, ttft_slo_s=slo.ttft_ms / 1000,
            itl_slo_s=slo.tpot_ms / 1000,
            prompt_tokens=max(1, round(w.prompt.mean + w.prefix_tokens)),
            output_tokens=max(1, round(w.output.mean)), max_num_seqs=fleet.shape.max_num_seqs,
            window_s=10.0, down_dwell_s=10.0, down_after_up_s=20.0)
        model = CapacityModel(fleet.profile, fleet.shape.max_num_seqs, self.config.itl_slo_s)
        self.law = ScalingLaw(self.config, model)
        self.state = LawState()
        self.desired = 1

    def attach(self) -> None:
        self.fleet.on_tick = self.tick

    def tick(self) -> None:
        fleet = self.fleet
        if fleet.is_done():
            return
        decision = self.law.decide(self._signals(), self.state)
        if decision.direction != HOLD:
            self._apply(decision.desired)
        fleet.push(fleet.now + self.config.interval_s, "tick")

    def _signals(self) -> Signals:
        fleet, cfg, now = self.fleet, self.config, self.fleet.now
        arrivals = deque(t.arrival_s for t in fleet.result.turns
                         if t.arrival_s >= now - cfg.window_s)
        recent = sum(1 for a in arrivals if a >= now - cfg.recent_s)
        ttfts = sorted(t.first_token_s - t.arrival_s for t in fleet.result.turns
                       if t.first_token_s is not None
                       and t.first_token_s >= now - cfg.ttft_window_s)
        live = [i for i in fleet.instances if i.stopped_at is None]
        ready = [i for i in live if i.view.is_routable]
        stats = [i.engine.stats() for i in ready]
        return Signals(
            now=now, desired=self.desired, ready=len(ready),
            arrival_rate=len(arrivals) / min(cfg.window_s, max(now, cfg.recent_s)),
            recent_rate=recent / cfg.recent_s, num_recent=recent,
            waiting=sum(s.num_waiting for s in stats),
            in_flight=sum(i.view.num_in_flight for i in live),
            ttft_p95_s=ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
            kv_usage=sum(s.kv_usage for s in stats) / len(stats) if stats else 0.0)

    def _apply(self, desired: int) -> None:
        fleet = self.fleet
        live = [i for i in fleet.instances if i.stopped_at is None and not i.view.is_draining]
        for _ in range(desired - len(live)):
            fleet.add_instance(ready_s=fleet.costs.start_s)
        ordered = sorted(live, key=lambda i: (i.view.state == "ready", i.view.num_in_flight))
        for instance in ordered[:max(0, len(live) - desired)]:
            instance.view.is_draining = True  # a starting one first, else the least busy
            if not instance.has_work:
                instance.stopped_at = fleet.now
        self.desired = desired


__all__ = ["Autoscaler", "autoscale"]
