"""A fleet on a virtual clock, driven by the real scaling law: an hour of traffic in seconds.

Requests arrive as a Poisson process of a given rate(t). The gateway holds them in one FIFO and
sends each to the least busy ready instance with a free running slot (as `--instance-slots`
does); an instance runs up to `max_num_seqs` requests, each for the profile's prefill plus its
output tokens at the step time of the batch it joined (capacity.py), so its time to first token
is its wait at the gateway plus the prefill and one step. A new instance takes `start_s` to be
ready; one the law removes stops taking requests and leaves when its last one ends (nothing is
lost). Every `interval_s` the law reads the same signals the real controller reads.

Events are processed in time order from one heap; nothing sleeps.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.autoscale.law import HOLD, Decision, LawState, ScalingLaw, Signals


@dataclass(slots=True)
class _Instance:
    started_at: float
    ready_at: float
    active: int = 0
    is_draining: bool = False
    stopped_at: float | None = None

    def is_ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.is_draining and self.stopped_at is None


@dataclass(slots=True)
class Second:
    """One second of a run."""

    t: int
    rate: float  # the load asked for
    arrivals: int
    desired: int
    ready: int
    instances: int  # running or starting or draining: what is paid for
    queued: int
    ttft_p95_s: float | None


@dataclass(slots=True)
class FleetRun:
    seconds: list[Second] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)  # changes only
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (arrival, TTFT s)
    instance_seconds: float = 0.0
    num_requests: int = 0
    num_served: int = 0

    def direction_changes(self, start_s: float = 0.0, end_s: float = math.inf) -> int:
        directions = [d.direction for t, d in self.decisions if start_s <= t < end_s]
        return sum(1 for a, b in zip(directions, directions[1:], strict=False) if a != b)


class VirtualFleet:
    def __init__(self, law: ScalingLaw, *, start_s: float = 5.0, initial_replicas: int = 1,
                 seed: int = 0) -> None:
        self.law = law
        self.config = law.config
        self.start_s = start_s
        self.initial_replicas = initial_replicas
        self.rng = random.Random(seed)

    def run(self, rate: Callable[[float], float], duration_s: float) -> FleetRun:
        sim = _Sim(self, rate)
        return sim.run(duration_s)


class _Sim:
    def __init__(self, fleet: VirtualFleet, rate: Callable[[float], float]) -> None:
        self.fleet, self.law, self.cfg, self.rate = fleet, fleet.law, fleet.config, rate
        self.now = 0.0
        self.instances = [_Instance(0.0, 0.0) for _ in range(fleet.initial_replicas)]
        self.desired = fleet.initial_replicas
        self.queue: deque[float] = deque()
        self.events: list[tuple[float, int, str, _Instance | None]] = []
        self.count = 0
        self.recent_arrivals: deque[float] = deque()
        self.recent_ttfts: deque[tuple[float, float]] = deque()
        self.state = LawState()
        self.out = FleetRun()

    def run(self, duration_s: float) -> FleetRun:
        self._push(0.0, "tick")
        self._push(0.0, "second")
        self._schedule_arrivals(0)
        while self.events:
            t, _, kind, instance = heapq.heappop(self.events)
            if t > duration_s:
                break
            self.now = t
            getattr(self, f"_on_{kind}")(instance)
        return self.finish(duration_s)

    def _push(self, t: float, kind: str, instance: _Instance | None = None) -> None:
        self.count += 1
        heapq.heappush(self.events, (t, self.count, kind, instance))

    def _schedule_arrivals(self, second: int) -> None:
        """This second's arrivals, and the event that schedules the next second's."""
        n = _poisson(self.fleet.rng, self.rate(second))
        for offset in sorted(self.fleet.rng.random() for _ in range(n)):
            self._push(second + offset, "arrival")
        self._push(second + 1.0, "next_second")

    def _on_next_second(self, _: _Instance | None) -> None:
        self._schedule_arrivals(int(round(self.now)))

    def _on_arrival(self, _: _Instance | None) -> None:
        self.out.num_requests += 1
        self.recent_arrivals.append(self.now)
        self.queue.append(self.now)
        self._dispatch()

    def _on_finish(self, instance: _Instance | None) -> None:
        assert instance is not None
        instance.active -= 1
        self.out.num_served += 1
        if instance.is_draining and instance.active == 0:
            instance.stopped_at = self.now
        self._dispatch()

    def _on_ready(self, instance: _Instance | None) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        slots = self.cfg.max_num_seqs
        ready = [i for i in self.instances if i.is_ready(self.now) and i.active < slots]
        while self.queue and ready:
            instance = min(ready, key=lambda i: i.active)
            arrived = self.queue.popleft()
            instance.active += 1
            cfg, model = self.cfg, self.law.model
            first_token_s = (model.prefill_ms(cfg.prompt_tokens) + model.step_ms(
                instance.active, cfg.prompt_tokens, cfg.output_tokens)) / 1000
            # its lifetime: its decode steps, and the prefills of those replacing others
            self.out.ttfts.append((arrived, self.now - arrived + first_token_s))
            self.recent_ttfts.append((self.now, self.now - arrived + first_token_s))
            latency = model.latency_s(instance.active, cfg.prompt_tokens, cfg.output_tokens)
            self._push(self.now + latency, "finish", instance)
            if instance.active >= slots:
                ready.remove(instance)

    def _on_tick(self, _: _Instance | None) -> None:
        decision = self.law.decide(self._signals(), self.state)
        if decision.direction != HOLD:
            self.out.decisions.append((self.now, decision))
            self._apply(decision.desired)
        self._push(self.now + self.cfg.interval_s, "tick")

    def _signals(self) -> Signals:
        window = self.cfg.window_s
        while self.recent_arrivals and self.recent_arrivals[0] < self.now - window:
            self.recent_arrivals.popleft()
        while self.recent_ttfts and self.recent_ttfts[0][0] < self.now - self.cfg.ttft_window_s:
            self.recent_ttfts.popleft()
        ttfts = sorted(v for _, v in self.recent_ttfts)
        num_recent = sum(1 for a in self.recent_arrivals if a >= self.now - self.cfg.recent_s)
        return Signals(
            now=self.now, desired=self.desired,
            ready=sum(1 for i in self.instances if i.is_ready(self.now)),
            arrival_rate=len(self.recent_arrivals) / min(window, max(self.now, self.cfg.recent_s)),
            recent_rate=num_recent / self.cfg.recent_s, num_recent=num_recent,
            queued=len(self.queue),
            in_flight=sum(i.active for i in self.instances),
            ttft_p95_s=ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None)

    def _apply(self, desired: int) -> None:
        live = [i for i in self.instances if not i.is_draining and i.stopped_at is None]
        for _ in range(desired - len(live)):
            instance = _Instance(self.now, self.now + self.fleet.start_s)
            self.instances.append(instance)
            self._push(instance.ready_at, "ready", instance)
        for instance in sorted(live, key=lambda i: (i.ready_at <= self.now, i.active))[
                :max(0, len(live) - desired)]:
            instance.is_draining = True  # a starting one first, else the least busy
            if instance.active == 0:
                instance.stopped_at = self.now
        self.desired = desired

    def _on_second(self, _: _Instance | None) -> None:
        t = int(round(self.now))
        self.out.seconds.append(Second(
            t, self.rate(max(0, t - 1)), 0, self.desired,
            sum(1 for i in self.instances if i.is_ready(self.now)),
            sum(1 for i in self.instances if i.stopped_at is None), len(self.queue), None))
        self._push(self.now + 1.0, "second")

    def finish(self, duration_s: float) -> FleetRun:
        """Cost, and each second's arrivals and TTFT p95 (by the second they arrived in)."""
        out = self.out
        out.instance_seconds = sum((i.stopped_at if i.stopped_at is not None else duration_s)
                                   - i.started_at for i in self.instances)
        by_second: dict[int, list[float]] = {}
        for arrived, ttft in out.ttfts:
            by_second.setdefault(int(arrived), []).append(ttft)
        for second in out.seconds:
            values = sorted(by_second.get(second.t - 1, ()))
            second.arrivals = len(values)
            second.ttft_p95_s = values[int(0.95 * (len(values) - 1))] if values else None
        return out


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's for small means, a rounded normal for large ones)."""
    if mean <= 0:
        return 0
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def oracle_replicas(rate: float, law: ScalingLaw) -> int:
    """The fewest replicas that serve `rate` at the law's capacity, each fully used: the
    offline oracle knows the load of every second and pays for nothing more."""
    return math.ceil(rate / law.mu - 1e-9)


__all__ = ["FleetRun", "Second", "VirtualFleet", "oracle_replicas"]
