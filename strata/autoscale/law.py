"""The scaling law: from one snapshot of signals to the number of replicas a deployment wants.
Pure: the controller (controller.py) and the planner's fleet (strata/plan/autoscaled.py) feed it
the same way.

    capacity   mu = requests/s one instance serves at its SLO batch (capacity.py, the profile)
    correction k = measured / modelled requests in flight (Little's law, averages over the
               rate's window) while nothing waits and a whole window has passed since the
               fleet last changed size; a slow moving average within [0.5, 4]: the profile
               corrected by what is measured
    load       rate * k / mu = replicas' worth of work; needed = load / target_utilization
    fast path  the backlog (gateway queue + engine queues) grows faster than the model says it
               should: needed covers what is served plus the growth, plus what the running
               slots of the fleet cannot take at once cleared within drain_backlog_s; or the
               rate of the last seconds is well above the window's (a step): needed follows
               what that rate surely is. No dwell
    from zero  no replica and a request arrives: one at once (requests wait at the gateway)
    TTFT       p95 over the SLO while requests wait and every replica is ready: one more
               (after the up dwell)
    ITL        decode instances (a pool of role decode) running more sequences each than the
               batch whose step keeps the ITL target: one more (after the up dwell). The
               gateway does not time tokens; the step is the profile's at the measured batch
    pools      one law per pool (prefill, decode, a class's): the capacity model of its role
               (capacity.py), its own state, dwell and bounds (controller.py)
    up         to ceil(needed), at most max_replicas, ups `up_dwell_s` apart (fast path: at once)
    down       only when N-1 replicas would run under down_utilization with no backlog and
               the SLO kept, and have for `down_dwell_s` without a break (also since the last
               down), `down_after_up_s` after an up: to ceil(needed) (what an up would choose
               at this load: after a burst, the whole way back in one step, not one instance
               per dwell), at least one fewer; the launcher drains the instances it removes
Desired counts starting replicas, so a decision is never taken twice while instances start.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig

UP, DOWN, HOLD = "up", "down", "hold"
_CORRECTION_WEIGHT = 0.05
_GROWTH_MARGIN_RPS = 0.5  # the backlog grows faster than the model says by more than this
_GROWTH_RATIO = 1.25  # ...and than this many times what it says
_GROWTH_SIGMAS = 3.0  # ...and by this many standard deviations of the arrivals behind it
_TOLERANCE = 0.05  # of a replica: a need of 2.04 replicas is met by 2
_STEP_RATIO = 1.5  # the recent rate this far above the window's is a step, not noise
_STEP_SIGMAS = 5.0  # ...and this many standard deviations above it
_MIN_RECENT = 10  # ...and counts at least this many arrivals


@dataclass(frozen=True, slots=True)
class Signals:
    """One reading of the fleet, as the law sees it."""

    now: float
    desired: int  # the deployment's replicas now (ready + starting)
    ready: int  # instances taking requests
    arrival_rate: float  # requests/s over the window
    recent_rate: float | None = None  # requests/s over the last seconds (steps show here first)
    num_recent: int = 0  # the arrivals recent_rate counts
    queued: int = 0  # waiting at the gateway
    waiting: int = 0  # waiting in the instances' engine queues (their reports)
    in_flight: int = 0  # sent to instances and not finished
    ttft_p95_s: float | None = None  # over the window; None: no sample
    itl_p95_s: float | None = None  # gaps between relayed chunks over the window; None: none
    kv_usage: float = 0.0  # mean over ready instances
    in_flight_tokens: int = 0
    running: int = 0  # sequences running in the instances (their reports)

    @property
    def backlog(self) -> int:
        return self.queued + self.waiting


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    direction: str  # up, down or hold
    reason: str
    needed: float  # replicas the model asks for, before dwell and bounds
    correction: float


@dataclass(slots=True)
class LawState:
    """What the law remembers between decisions."""

    last_up_at: float = -math.inf
    last_down_at: float = -math.inf
    correction: float = 1.0
    backlogs: deque[tuple[float, int]] = field(default_factory=deque)  # (time, backlog)
    in_flights: deque[tuple[float, float]] = field(default_factory=deque)  # (time, per ready)
    down_ok_since: float | None = None  # since when N-1 replicas would have had headroom
    started_at: float | None = None  # the first decision: rates need a full window after it


class ScalingLaw:
    def __init__(self, config: AutoscaleConfig, model: CapacityModel) -> None:
        self.config = config
        self.model = model
        self.mu = model.requests_per_s(config.prompt_tokens, config.output_tokens)

    def decide(self, s: Signals, state: LawState) -> Decision:
        if state.started_at is None:
            state.started_at = s.now
        self._correct(s, state)
        needed, is_fast = self._needed(s, state)
        cfg = self.config
        if s.desired < cfg.min_replicas or s.desired > cfg.max_replicas:
            return self._to(min(max(s.desired, cfg.min_replicas), cfg.max_replicas), s, state,
                            "bounds", needed)
        if s.desired == 0:
            if s.backlog or s.arrival_rate > 0 or s.in_flight:
                return self._to(max(1, min(math.ceil(needed), cfg.max_replicas)), s, state,
                                "from_zero", needed)
            return self._hold(s, state, "idle", needed)
        wanted = math.ceil(needed - _TOLERANCE)
        reason = "fast_path" if is_fast else "capacity"
        slo = self._slo_broken(s)
        if slo and (s.backlog or slo == "itl_slo") and s.ready >= s.desired \
                and wanted <= s.desired:
            wanted, reason = s.desired + 1, slo
        if not is_fast and reason != slo and s.now - state.started_at < cfg.window_s:
            return self._hold(s, state, "first_window", needed)  # its rate is not measured yet
        if wanted > s.desired:
            return self._up(min(wanted, cfg.max_replicas), s, state, reason, needed, is_fast)
        if wanted < s.desired:
            return self._down(s, state, needed)
        state.down_ok_since = None
        return self._hold(s, state, "within_band", needed)

    def load(self, s: Signals, correction: float) -> float:
        """Replicas' worth of work at full use."""
        return s.arrival_rate * correction / self.mu

    def _needed(self, s: Signals, state: LawState) -> tuple[float, bool]:
        k, cfg = state.correction, self.config
        needed = self.load(s, k) / cfg.target_utilization
        is_fast = False
        if self._is_step(s):  # sized by what the recent count surely exceeds (2 sigma below it)
            surely = (s.num_recent - 2 * math.sqrt(s.num_recent)) / cfg.recent_s
            needed = max(needed, surely * k / self.mu / cfg.target_utilization)
            is_fast = True
        growth = self._backlog_growth(s, state)
        expected = max(0.0, s.arrival_rate - s.ready * self.mu / k)
        excess = (growth - expected) * cfg.recent_s  # requests more than the model expects
        if s.backlog and growth > _GROWTH_RATIO * expected + _GROWTH_MARGIN_RPS \
                and excess > _GROWTH_SIGMAS * math.sqrt(max(1.0, expected * cfg.recent_s)):
            demand = s.ready * self.mu / k + growth
            free_slots = max(0, s.desired * cfg.max_num_seqs - s.in_flight)  # take it at once
            clear = max(0, s.backlog - free_slots) * k / (self.mu * cfg.drain_backlog_s)
            needed = max(needed, demand * k / self.mu / cfg.target_utilization + clear)
            is_fast = True
        return needed, is_fast

    def _backlog_growth(self, s: Signals, state: LawState) -> float:
        """Requests/s the backlog grew by over the last `recent_s`."""
        history = state.backlogs
        history.append((s.now, s.backlog))
        while len(history) > 1 and history[1][0] <= s.now - self.config.recent_s:
            history.popleft()
        then, before = history[0]
        return (s.backlog - before) / (s.now - then) if s.now > then else 0.0

    def _is_step(self, s: Signals) -> bool:
        """The recent arrivals are too many for the window's rate to explain: more than
        `_STEP_RATIO` times it and `_STEP_SIGMAS` standard deviations (Poisson) above it."""
        if s.recent_rate is None or s.num_recent < _MIN_RECENT:
            return False
        expected = s.arrival_rate * s.num_recent / s.recent_rate  # arrivals over recent_s
        return (s.recent_rate > _STEP_RATIO * s.arrival_rate
                and s.num_recent > expected + _STEP_SIGMAS * math.sqrt(max(expected, 1.0)))

    def _correct(self, s: Signals, state: LawState) -> None:
        """Measured / modelled requests in flight per ready instance, both over the rate's
        window (Little's law holds for averages over one span), while nothing waits and the
        load holds still."""
        cfg = self.config
        samples = state.in_flights
        if s.ready:
            samples.append((s.now, s.in_flight / s.ready))
        while samples and samples[0][0] < s.now - cfg.window_s:
            samples.popleft()
        settled_at = max(state.last_up_at, state.last_down_at, state.started_at or s.now)
        if not samples or s.backlog or s.arrival_rate <= 0 or self._is_moving(s) \
                or s.now - settled_at < cfg.window_s:
            return
        per_instance = sum(v for _, v in samples) / len(samples)
        modelled = s.arrival_rate / max(1, s.ready) * self.model.latency_s(
            per_instance, cfg.prompt_tokens, cfg.output_tokens)
        if modelled < 0.5:  # too few requests in flight to measure anything
            return
        ratio = min(4.0, max(0.5, per_instance / modelled))
        state.correction += _CORRECTION_WEIGHT * (ratio - state.correction)

    def _is_moving(self, s: Signals) -> bool:
        if s.recent_rate is None or s.num_recent == 0:
            return False
        expected = s.arrival_rate * s.num_recent / s.recent_rate
        return abs(s.num_recent - expected) > 2 * math.sqrt(max(expected, 1.0))

    def _slo_broken(self, s: Signals) -> str:
        """"ttft_slo", "itl_slo", or "". ITL is the gaps the gateway measured between relayed
        chunks when it has some; else, for a decode pool, the profile's step at the batch each
        instance runs. A prefill pool has no ITL of its own."""
        cfg = self.config
        if s.ttft_p95_s is not None and s.ttft_p95_s > cfg.ttft_slo_s:
            return "ttft_slo"
        if self.model.role == "prefill":
            return ""
        itl_s = s.itl_p95_s
        if itl_s is None and self.model.role == "decode" and s.ready:
            itl_s = self.model.itl_s(s.running / s.ready, cfg.prompt_tokens, cfg.output_tokens)
        if itl_s is not None and itl_s > cfg.itl_slo_s:
            return "itl_slo"
        return ""

    def _up(self, desired: int, s: Signals, state: LawState, reason: str, needed: float,
            is_fast: bool) -> Decision:
        if desired <= s.desired:
            return self._hold(s, state, "at_max_replicas", needed)
        if not is_fast and s.now - state.last_up_at < self.config.up_dwell_s:
            return self._hold(s, state, "up_dwell", needed)
        return self._to(desired, s, state, reason, needed)

    def _down(self, s: Signals, state: LawState, needed: float) -> Decision:
        cfg = self.config
        if s.desired <= cfg.min_replicas:
            return self._hold(s, state, "at_min_replicas", needed)
        smaller = s.desired - 1
        is_tight = self.load(s, state.correction) > cfg.down_utilization * smaller
        why_not = ("backlog" if s.backlog else self._slo_broken(s)
                   or ("no_headroom_at_n_minus_1" if is_tight else ""))
        if why_not:
            state.down_ok_since = None
            return self._hold(s, state, why_not, needed)
        if state.down_ok_since is None:
            state.down_ok_since = s.now
        why_not = (
            "down_after_up" if s.now - state.last_up_at < cfg.down_after_up_s else
            "down_dwell" if s.now - max(state.down_ok_since, state.last_down_at)
            < cfg.down_dwell_s else "")
        if why_not:
            return self._hold(s, state, why_not, needed)
        state.down_ok_since = None
        to = max(cfg.min_replicas, min(smaller, math.ceil(needed - _TOLERANCE)))
        return self._to(to, s, state, "headroom_at_n_minus_1", needed)

    def _to(self, desired: int, s: Signals, state: LawState, reason: str,
            needed: float) -> Decision:
        if desired > s.desired:
            state.last_up_at = s.now
            direction = UP
        elif desired < s.desired:
            state.last_down_at = s.now
            direction = DOWN
        else:
            direction = HOLD
        return Decision(desired, direction, reason, needed, state.correction)

    def _hold(self, s: Signals, state: LawState, reason: str, needed: float) -> Decision:
        return Decision(s.desired, HOLD, reason, needed, state.correction)


__all__ = ["DOWN", "HOLD", "UP", "Decision", "LawState", "ScalingLaw", "Signals"]
