"""The scaling law (strata/autoscale/law.py): unit rules, then stories on a virtual clock over
the real law and the bundled profile, on the planner's fleet with the capacity model's instances
(strata/plan/autoscaled.py: run_autoscaled), an hour in seconds."""

from __future__ import annotations

import math
import time

import pytest

from strata.autoscale.capacity import CapacityModel
from strata.autoscale.config import AutoscaleConfig
from strata.autoscale.law import DOWN, HOLD, UP, LawState, ScalingLaw, Signals
from strata.errors import ConfigError
from strata.plan.autoscaled import oracle_replicas, run_autoscaled
from strata.sim import load_profile

PROFILE = load_profile("smollm2-cpu")


def make_law(**fields: object) -> ScalingLaw:
    config = AutoscaleConfig(**{"min_replicas": 1, "max_replicas": 16, **fields})  # type: ignore[arg-type]
    return ScalingLaw(config, CapacityModel(PROFILE, config.max_num_seqs, config.itl_slo_s))


def at(law: ScalingLaw, now: float, desired: int, load: float, **fields: object) -> Signals:
    """Signals at `now` with `load` replicas' worth of arrivals, all ready, and as many
    requests in flight as the model predicts (so the correction stays 1)."""
    ready = int(fields.pop("ready", desired))  # type: ignore[call-overload]
    rate, per_instance = load * law.mu, 1.0
    for _ in range(50):  # Little's law: L = rate / ready * T(L)
        per_instance = rate / max(1, ready) * law.model.latency_s(per_instance, 200, 100)
    return Signals(now=now, desired=desired, ready=ready, arrival_rate=rate,
                   in_flight=round(per_instance * ready), **fields)  # type: ignore[arg-type]


def test_the_profile_gives_the_capacity_at_the_slo_batch() -> None:
    model = CapacityModel(PROFILE, 64, itl_slo_s=0.03)
    batch = model.batch_for_itl(200, 100)
    assert model.step_ms(batch, 200, 100) <= 30.0 < model.step_ms(batch + 1, 200, 100)
    assert CapacityModel(PROFILE, 64, 1.0).requests_per_s(200, 100) > \
        model.requests_per_s(200, 100)  # a looser ITL target allows bigger batches


def test_up_to_the_load_over_target_utilization_then_the_up_dwell() -> None:
    law, state = make_law(window_s=1.0), LawState()
    law.decide(at(law, 0.0, 2, 1.0), state)
    up = law.decide(at(law, 1.0, 2, 3.5), state)
    assert (up.direction, up.desired, up.reason) == (UP, 4, "capacity")  # 3.5 / 0.9 -> 4
    again = law.decide(at(law, 1.5, 4, 4.5), state)
    assert (again.direction, again.reason) == (HOLD, "up_dwell")
    assert law.decide(at(law, 3.0, 4, 4.5), state).desired == 5


def test_a_broken_slo_holds_a_scale_down_even_when_the_load_is_low() -> None:
    """A fleet missing its TTFT target never shrinks, however little work it has (the
    load test alone would allow it)."""
    law = make_law(window_s=1.0, down_dwell_s=0.0, down_after_up_s=0.0, ttft_slo_s=2.0)
    state = LawState(started_at=-10.0)
    slow = law.decide(at(law, 1.0, 4, 0.5, ttft_p95_s=3.0), state)
    assert (slow.direction, slow.reason) == (HOLD, "ttft_slo")
    fine = law.decide(at(law, 2.0, 4, 0.5, ttft_p95_s=1.0), state)
    assert fine.direction == DOWN


def test_down_one_at_a_time_only_with_headroom_at_n_minus_1_for_the_dwell() -> None:
    law = make_law(window_s=1.0, down_dwell_s=30.0, down_after_up_s=60.0)
    state = LawState(last_up_at=0.0, started_at=-10.0)
    steps = [law.decide(at(law, t, n, load), state)
             for t, n, load in ((1.0, 4, 2.3), (59.5, 4, 2.3), (61.0, 4, 2.3),
                                (62.0, 3, 1.5), (91.5, 3, 1.5), (92.0, 3, 1.5))]
    assert [(d.direction, d.reason, d.desired) for d in steps] == [
        (HOLD, "down_after_up", 4), (HOLD, "down_after_up", 4),
        (DOWN, "headroom_at_n_minus_1", 3),  # 2.3 <= 0.8 * 3 has held since 1 s
        (HOLD, "down_dwell", 3), (HOLD, "down_dwell", 3),
        (DOWN, "headroom_at_n_minus_1", 2)]  # 1.5 <= 0.8 * 2, held for 30 s since 62 s
    no_room = law.decide(at(law, 200.0, 3, 1.7), state)  # 1.7 > 0.8 * 2
    assert (no_room.direction, no_room.reason) == (HOLD, "no_headroom_at_n_minus_1")
    queued = law.decide(at(law, 300.0, 3, 0.5, queued=3), state)
    assert (queued.direction, queued.reason) == (HOLD, "backlog")


def test_from_zero_one_replica_at_once_and_the_bounds_hold() -> None:
    law = make_law(min_replicas=0, max_replicas=3)
    first = law.decide(at(law, 0.0, 0, 0.0, queued=1), LawState())
    assert (first.direction, first.desired, first.reason) == (UP, 1, "from_zero")
    assert law.decide(at(law, 0.0, 0, 0.0), LawState()).reason == "idle"
    assert law.decide(at(law, 0.0, 5, 0.0), LawState()).desired == 3  # above max: back
    many = law.decide(at(law, 100.0, 3, 50.0), LawState(started_at=0.0))
    assert (many.desired, many.reason) == (3, "at_max_replicas")


def test_a_backlog_growing_faster_than_modelled_skips_the_dwell() -> None:
    law, state = make_law(window_s=1.0), LawState(started_at=0.0, last_up_at=9.5)
    law.decide(at(law, 9.0, 2, 1.0, queued=0), state)
    fast = law.decide(at(law, 10.0, 2, 1.0, queued=40), state)  # 40 requests in one second
    assert (fast.direction, fast.reason) == (UP, "fast_path") and fast.desired >= 3


def test_ttft_over_the_slo_while_requests_wait_adds_one() -> None:
    law, state = make_law(window_s=1.0), LawState(started_at=0.0)
    slow = law.decide(at(law, 10.0, 2, 1.0, waiting=2, ttft_p95_s=5.0), state)
    assert (slow.desired, slow.reason) == (3, "ttft_slo")
    law2, state2 = make_law(window_s=1.0), LawState(started_at=0.0)
    assert law2.decide(at(law2, 10.0, 2, 1.0, ttft_p95_s=5.0), state2).direction == HOLD


def test_bad_settings_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="gap is what keeps the fleet from flapping"):
        AutoscaleConfig(target_utilization=0.7, down_utilization=0.8)
    with pytest.raises(ConfigError, match="--min-replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)


# --- on a virtual clock -------------------------------------------------------------------


def test_after_a_4x_step_the_first_decision_comes_within_2_s_and_ttft_within_s_plus_5() -> None:
    law, start_s, step_at = make_law(ttft_slo_s=1.0), 5.0, 120
    base = 0.8 * law.mu
    run = run_autoscaled(law, PROFILE, lambda t: base if t < step_at else 4 * base, 400,
                         start_s=start_s)
    first_up = min(t for t, d in run.decisions if t >= step_at and d.direction == UP)
    assert first_up - step_at <= 2.0
    over = [t for t, p95 in run.ttft_p95_by_second().items() if t >= step_at and p95 > 1.0]
    assert over, "the step must hurt before the fleet grows (else this proves nothing)"
    assert max(over) - step_at <= start_s + 5.0
    assert run.ticks[-1].desired == math.ceil(4 * base / law.mu / 0.9)


def test_from_zero_replicas_the_first_token_comes_within_s_plus_1() -> None:
    law = make_law(min_replicas=0, max_replicas=4)
    run = run_autoscaled(law, PROFILE, lambda t: 0.0 if t < 30 else 2.0, 200, start_s=5.0,
                         initial_replicas=0)
    assert [(d.direction, d.reason) for _, d in run.decisions][:1] == [(UP, "from_zero")]
    first_arrival, first_ttft = min(run.ttfts)
    assert 30.0 <= first_arrival and first_ttft <= 5.0 + 1.0
    assert run.num_served >= run.num_requests - 64  # the last seconds' are still running


@pytest.mark.parametrize("load", [0.7, 2.7, 6.3])
def test_steady_load_changes_direction_at_most_once_in_10_minutes(load: float) -> None:
    """Half an hour here; bench/autoscale.py runs the hour."""
    law = make_law()
    run = run_autoscaled(law, PROFILE, lambda t: load * law.mu, 1800, start_s=5.0,
                         initial_replicas=math.ceil(load / 0.9), seed=int(load * 10))
    assert run.num_served > 0.95 * load * law.mu * 1800
    for start in range(0, 1800, 600):
        assert run.direction_changes(start, start + 600) <= 1, run.decisions


def test_an_hour_of_diurnal_load_with_bursts_in_a_second_keeps_the_slo_near_the_oracle() -> None:
    law = make_law()
    mu = law.mu

    def rate(t: float) -> float:
        bursts = 2.0 if 1200 <= t < 1260 or 2400 <= t < 2430 else 1.0
        return mu * (2.5 + 2.0 * math.sin(2 * math.pi * t / 3600)) * bursts

    started = time.perf_counter()
    run = run_autoscaled(law, PROFILE, rate, 3600, start_s=5.0, initial_replicas=3, seed=1)
    assert time.perf_counter() - started < 60.0
    oracle = sum(oracle_replicas(rate(t), law) for t in range(3600))
    over_slo = [t for t, p95 in run.ttft_p95_by_second().items() if p95 > law.config.ttft_slo_s]
    assert run.num_requests > 40_000 and not over_slo
    assert run.fleet.instance_seconds / oracle <= 1.3  # measured 1.19 (docs/benchmarks.md)
    assert run.direction_changes() <= 6


def test_after_a_burst_down_goes_to_what_the_load_needs_in_one_step() -> None:
    law = make_law(window_s=1.0, down_dwell_s=30.0, down_after_up_s=60.0)
    state = LawState(last_up_at=0.0, started_at=-10.0)
    held = law.decide(at(law, 1.0, 10, 4.2), state)  # the burst is over: 4.2 <= 0.8 * 9
    down = law.decide(at(law, 61.0, 10, 4.2), state)
    assert (held.reason, down.direction, down.desired) == ("down_after_up", DOWN, 5)
    assert law.decide(at(law, 62.0, 5, 4.2), state).direction == HOLD  # 4.2 / 0.9 needs 5


def test_each_pool_is_held_to_the_targets_of_the_classes_that_live_in_it() -> None:
    config = AutoscaleConfig(ttft_slo_s=2.0, itl_slo_s=0.1,
                             class_slos=(("interactive", 0.5, 0.05), ("batch", 8.0, 0.4)),
                             class_pools=(("interactive", "fast"),))
    assert config.slos_of("fast") == (0.5, 0.05)  # interactive's home
    assert config.slos_of("default") == (8.0, 0.4)  # batch lives where no class is named
    assert AutoscaleConfig(class_slos=(("interactive", 0.5, 0.05),)).slos_of("default") == (
        0.5, 0.05)  # no class pools: every class lives everywhere, the strictest wins
    with pytest.raises(ConfigError, match="must be positive"):
        AutoscaleConfig(class_slos=(("batch", 0.0, 1.0),))


def test_a_measured_itl_over_the_pools_target_scales_it_up_never_down() -> None:
    """The gaps the gateway measured between relayed chunks are the ITL the law keeps, for a
    mixed pool as for a decode one: over the target, more instances, however low the load."""
    law = make_law(window_s=1.0, down_dwell_s=0.0, down_after_up_s=0.0, itl_slo_s=0.05)
    state = LawState(started_at=-10.0)
    slow = law.decide(at(law, 1.0, 4, 0.5, itl_p95_s=0.08), state)
    assert (slow.direction, slow.reason) == (UP, "itl_slo")
    assert law.decide(at(law, 5.0, 5, 0.5, itl_p95_s=0.03), state).direction == DOWN
