"""The simulation against times worked out by hand from the round profile (conftest.py)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence

import pytest

from strata.clock import Clock
from strata.errors import ConfigError
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import (
    POLICIES,
    CacheAwarePolicy,
    PolicyContext,
    RouteRequest,
    register_policy,
)
from strata.plan import Architecture, Costs, EngineShape, LengthDist, PlanInputs, Slo, Workload
from strata.plan.arch import families, replica_policies
from strata.plan.fleet import Fleet
from strata.plan.search import simulate
from strata.plan.workload import Job
from strata.plan.workload import Turn as WorkloadTurn
from strata.sim.profile import LatencyProfile

NO_OVERHEAD = Costs(request_overhead_ms=0.0)
ONE = Architecture("one process", policy="round_robin")


def fixed(n: int, prompt: int, output: int, **load: float) -> Workload:
    return Workload(num_requests=n, prompt=LengthDist(prompt, prompt),
                    output=LengthDist(output, output), **load)  # type: ignore[arg-type]


def test_one_request_at_a_time_costs_one_prefill_then_one_decode_step_per_token(
        round_profile: LatencyProfile) -> None:
    run = Fleet(ONE, round_profile, fixed(3, 100, 5, concurrency=1), costs=NO_OVERHEAD).run()
    for turn in run.turns:
        assert turn.first_token_s - turn.arrival_s == pytest.approx(0.060)  # 10 + 0.5 * 100
        assert turn.finish_s - turn.first_token_s == pytest.approx(4 * 0.021)  # 20 + 1, x 4
        assert turn.num_output_tokens == 5
    assert run.turns[1].arrival_s == pytest.approx(0.060 + 4 * 0.021)  # closed loop
    assert run.busy_seconds == pytest.approx(3 * (0.060 + 4 * 0.021))


def test_the_request_overhead_adds_to_ttft_only(round_profile: LatencyProfile) -> None:
    run = Fleet(ONE, round_profile, fixed(1, 100, 5, concurrency=1),
                costs=Costs(request_overhead_ms=7.0)).run()
    turn = run.turns[0]
    assert turn.first_token_s - turn.arrival_s == pytest.approx(0.067)
    assert turn.finish_s - turn.first_token_s == pytest.approx(4 * 0.021)


def test_measured_overheads_are_drawn_one_per_request(round_profile: LatencyProfile) -> None:
    costs = Costs(request_overhead_ms=1000.0, request_overhead_samples_ms=(3.0, 9.0))
    run = Fleet(ONE, round_profile, fixed(40, 100, 5, concurrency=1), costs=costs).run()
    waits = {round((t.first_token_s - t.arrival_s) * 1000, 6) for t in run.turns}
    assert waits == {63.0, 69.0}  # 60 ms of prefill + one sample each; never the constant
    with pytest.raises(ConfigError, match="request_overhead_samples_ms"):
        Costs(request_overhead_samples_ms=(1.0, -1.0))


def test_poisson_arrivals_one_at_a_time_wait_as_in_m_d_1(round_profile: LatencyProfile) -> None:
    """One slot, deterministic service S = 60 ms, Poisson at 10/s (rho 0.6): the mean wait
    is rho S / (2 (1 - rho)) = 45 ms (Pollaczek-Khinchine), so the mean TTFT is 105 ms."""
    shape = EngineShape(max_num_seqs=1, max_num_batched_tokens=100)
    run = Fleet(ONE, round_profile, fixed(4000, 100, 1, rate_per_s=10.0), shape=shape,
                costs=NO_OVERHEAD).run()
    ttfts = [t.first_token_s - t.arrival_s for t in run.turns]
    assert min(ttfts) == pytest.approx(0.060)
    assert statistics.mean(ttfts) == pytest.approx(0.105, rel=0.1)
    assert run.busy_seconds / run.duration_s == pytest.approx(0.6, rel=0.05)


PD_COSTS = Costs(request_overhead_ms=0.0, transfer_ms_base=2.0, transfer_ms_per_token=0.04,
                 pd_min_uncached_tokens=64)
PD = Architecture("P/D", policy="least_load", replicas=1, num_prefill=1)


def test_prefill_decode_split_hands_the_blocks_over_instead_of_recomputing(
        round_profile: LatencyProfile) -> None:
    """Prefill of 100 tokens (60 ms), then 6 full blocks (96 tokens) move at 2 + 0.04 ms per
    token; the first token is released when they arrive. The decode side computes only the
    5 tokens past the blocks (10 + 2.5 ms, the second token), then decodes (21 ms)."""
    run = Fleet(PD, round_profile, fixed(1, 100, 5, concurrency=1), costs=PD_COSTS).run()
    turn = run.turns[0]
    assert turn.first_token_s - turn.arrival_s == pytest.approx(0.060 + 0.002 + 0.04 * 96 / 1000)
    assert turn.finish_s - turn.first_token_s == pytest.approx(0.0125 + 3 * 0.021)
    assert turn.num_output_tokens == 5


def test_under_p_d_a_prompt_shorter_than_the_threshold_stays_on_the_decode_side(
        round_profile: LatencyProfile) -> None:
    run = Fleet(PD, round_profile, fixed(1, 48, 5, concurrency=1), costs=PD_COSTS).run()
    turn = run.turns[0]
    assert turn.first_token_s - turn.arrival_s == pytest.approx(0.010 + 0.5 * 48 / 1000)
    assert run.busy_by_instance[0] == 0.0  # the prefill instance never ran


def test_the_default_p_d_threshold_is_the_gateways() -> None:
    from strata.sim.profile import load_profile

    assert Costs().pd_min_tokens(load_profile("smollm2-cpu")) == 368


def test_tensor_parallel_splits_the_token_terms_and_pays_the_all_reduces(
        round_profile: LatencyProfile) -> None:
    arch = Architecture("tensor parallel", policy="round_robin", tp=2)
    run = Fleet(arch, round_profile, fixed(1, 100, 2, concurrency=1), costs=NO_OVERHEAD).run()
    turn = run.turns[0]
    comm_s = 60 * 0.03 / 1000
    assert turn.first_token_s - turn.arrival_s == pytest.approx(0.010 + 0.025 + comm_s)
    assert turn.finish_s - turn.first_token_s == pytest.approx(0.020 + 0.0005 + comm_s)


def test_a_shared_prefix_is_computed_once_per_instance(round_profile: LatencyProfile) -> None:
    workload = Workload(num_requests=8, concurrency=1, prefix_tokens=160,
                        prompt=LengthDist(16, 16), output=LengthDist(2, 2))
    run = Fleet(ONE, round_profile, workload, costs=NO_OVERHEAD).run()
    cached = [t.num_cached_tokens for t in run.turns]
    assert cached == [0] + [160] * 7
    assert run.turns[1].first_token_s - run.turns[1].arrival_s == pytest.approx(0.010 + 0.008)


def test_cache_aware_keeps_time_on_the_plans_virtual_clock(round_profile: LatencyProfile) -> None:
    workload = Workload(num_requests=12, concurrency=3, prefix_tokens=160, num_prefixes=2,
                        prompt=LengthDist(16, 16), output=LengthDist(4, 4))
    fleet = Fleet(Architecture("replicas", replicas=2, policy="cache_aware"), round_profile,
                  workload, costs=NO_OVERHEAD)
    policy = fleet.gateway.pipeline.policy
    assert isinstance(policy, CacheAwarePolicy)
    run = fleet.run()
    # the load averages' window is the mean request duration in virtual seconds
    assert policy.averages.window_s == pytest.approx(
        statistics.fmean(t.finish_s - t.arrival_s for t in run.turns))


def test_sticky_sessions_and_kv_offload_hit_the_history_round_robin_recomputes(
        round_profile: LatencyProfile) -> None:
    """7 sessions of 6 turns over 4 instances: round robin lands a turn where its history is
    cached only by chance; sticky always (but the new tokens); KV offload fetches it."""
    workload = Workload(num_requests=42, concurrency=7, num_turns=6, prompt=LengthDist(64, 64),
                        output=LengthDist(4, 12))
    inputs = PlanInputs(workload, Slo(1000, 100), round_profile)
    sticky, _ = simulate(Architecture("sessions", replicas=4, policy="consistent_hash",
                                      sessions="sticky"), inputs)
    spread, _ = simulate(Architecture("replicas", replicas=4, policy="round_robin"), inputs)
    offload, run = simulate(Architecture("KV offload", replicas=4, policy="round_robin",
                                         kv_offload=True), inputs)
    assert sticky.prefix_hit_rate > spread.prefix_hit_rate + 0.15
    assert offload.prefix_hit_rate > spread.prefix_hit_rate + 0.15
    assert run.num_fetched_tokens > 0


def test_an_autoscaled_fleet_grows_under_a_load_one_instance_cannot_serve(
        round_profile: LatencyProfile) -> None:
    shape = EngineShape(max_num_seqs=1, max_num_batched_tokens=100)
    inputs = PlanInputs(fixed(1500, 100, 1, rate_per_s=40.0), Slo(500, 100), round_profile,
                        max_ranks=8, shape=shape)
    out, run = simulate(Architecture("autoscaled", replicas=8, autoscale=True), inputs)
    assert run.max_instances > 2
    assert 1.0 < out.instances < 8


class StickToFirst:
    """A toy stateful policy: the first instance it is given until that one has `limit`
    requests in flight by its own count, then the next; it keeps time only by the clock its
    row's factory was given (the times it saw land in `seen_at`)."""

    name = "stick_to_first"

    def __init__(self, clock: Clock, limit: int = 2) -> None:
        self.clock, self.limit = clock, limit
        self.in_flight: dict[str, int] = {}
        self.seen_at: list[float] = []

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        return next((v for v in candidates if self.in_flight.get(v.instance_id, 0) < self.limit),
                    candidates[-1])

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        self.in_flight[instance.instance_id] = self.in_flight.get(instance.instance_id, 0) + 1
        self.seen_at.append(self.clock())

    def on_request_finished(self, request: RouteRequest, instance: InstanceView, *,
                            is_success: bool) -> None:
        self.in_flight[instance.instance_id] -= 1


@pytest.fixture
def toy_policy() -> Iterator[list[StickToFirst]]:
    built: list[StickToFirst] = []

    def factory(context: PolicyContext) -> StickToFirst:
        built.append(StickToFirst(context.clock))
        return built[-1]

    register_policy("stick_to_first", factory)
    yield built
    del POLICIES["stick_to_first"]


def test_a_policy_added_to_the_table_is_planned_on_the_virtual_clock(
        round_profile: LatencyProfile, toy_policy: list[StickToFirst]) -> None:
    workload = Workload(num_requests=12, concurrency=3, prompt=LengthDist(16, 16),
                        output=LengthDist(4, 4))
    assert "stick_to_first" in replica_policies(workload)  # found in the table, no other edit
    assert "stick_to_first" in [f.base.policy for f in families(workload, max_ranks=4)]
    fleet = Fleet(Architecture("replicas", replicas=2, policy="stick_to_first"), round_profile,
                  workload, costs=NO_OVERHEAD)
    run = fleet.run()
    policy = toy_policy[-1]
    assert fleet.gateway.pipeline.policy is policy
    assert len(policy.seen_at) == 12 and policy.in_flight == {"i000": 0, "i001": 0}
    # its clock is the plan's: the times it read are the turns' arrivals, in virtual seconds
    assert policy.seen_at == sorted(t.arrival_s for t in run.turns)
    assert policy.seen_at[-1] == pytest.approx(max(t.arrival_s for t in run.turns))
    assert max(policy.seen_at) < 60  # a wall clock would read seconds since the epoch
    # 3 at a time, at most 2 on the first: the second instance served the overflow
    assert {i.instance_id: i.busy_s > 0 for i in fleet.instances} == {"i000": True, "i001": True}


def _jobs_at_zero(n: int, prompt: int, output: int) -> list[Job]:
    turn = WorkloadTurn(list(range(prompt)), output)
    return [Job(i, [], [turn], start_s=0.0) for i in range(n)]


def test_a_modelled_instance_runs_its_slots_and_queues_the_rest(
        round_profile: LatencyProfile) -> None:
    """The capacity model's instance (modelled.py), by hand: a request that starts as the b-th
    of a batch has its first token after a prefill (10 + 0.5 x 100 ms) and one decode step
    (20 + b ms), and leaves after b prefills and 5 decode steps; the third waits for a slot."""
    fleet = Fleet(ONE, round_profile, fixed(3, 100, 5, rate_per_s=1.0),
                  shape=EngineShape(max_num_seqs=2), costs=NO_OVERHEAD,
                  jobs=_jobs_at_zero(3, 100, 5), modelled=True)
    run = fleet.run()
    times = [(t.first_token_s, t.finish_s) for t in run.turns]
    assert times == [pytest.approx(x) for x in
                     [(0.081, 0.165), (0.082, 0.230), (0.165 + 0.082, 0.165 + 0.230)]]
    assert all(t.num_output_tokens == 5 for t in run.turns)
    assert run.busy_seconds == pytest.approx(0.395)


def test_instance_slots_hold_arrivals_at_the_gateway_until_an_instance_is_ready(
        round_profile: LatencyProfile) -> None:
    """With no instance, arrivals wait at the gateway (as --instance-slots with none routable);
    the one that starts at 1 s takes two (its slots), the third when the first finishes."""
    fleet = Fleet(ONE, round_profile, fixed(3, 100, 5, rate_per_s=1.0),
                  shape=EngineShape(max_num_seqs=2), costs=NO_OVERHEAD,
                  jobs=_jobs_at_zero(3, 100, 5), modelled=True, instance_slots=2,
                  initial_replicas=0)
    fleet.add_instance(ready_s=1.0)
    run = fleet.run()
    assert [t.first_token_s for t in run.turns] == [
        pytest.approx(x) for x in (1.081, 1.082, 1.165 + 0.082)]
    assert not fleet.held
    with pytest.raises(ValueError, match="slots"):
        Fleet(ONE, round_profile, fixed(1, 100, 5, rate_per_s=1.0), initial_replicas=0)


@pytest.mark.parametrize("sessions", ["external", "hybrid", "sticky"])
def test_a_strong_session_store_lengthens_each_turn_by_its_write_behind_levels_do_not(
        round_profile: LatencyProfile, sessions: str) -> None:
    """One session of 3 turns, one at a time: at `strong` each turn of a stored session ends
    (and the next starts) 25 ms after its last token; `eventual` writes behind; sticky sessions
    (no store) pay nothing at any level. TTFT and TPOT never carry the write."""
    workload = Workload(num_requests=3, concurrency=1, num_turns=3, prompt=LengthDist(50, 50),
                        output=LengthDist(5, 5))
    arch = Architecture("sessions", policy="consistent_hash", sessions=sessions)
    runs = {level: Fleet(arch, round_profile, workload, costs=Costs(
        request_overhead_ms=0.0, session_read_ms=0.0, session_consistency=level,
        session_write_ms=25.0)).run() for level in ("strong", "eventual")}
    write = 0.025 if sessions != "sticky" else 0.0
    for level, run in runs.items():
        for turn in run.turns:
            assert turn.answered_s - turn.finish_s == pytest.approx(
                write if level == "strong" else 0.0)
        for before, after in zip(run.turns, run.turns[1:], strict=False):
            assert after.arrival_s == pytest.approx(before.answered_s)  # no think time
    strong, eventual = runs["strong"].turns, runs["eventual"].turns
    assert [t.first_token_s - t.arrival_s for t in strong] == pytest.approx(
        [t.first_token_s - t.arrival_s for t in eventual])


def test_an_unknown_session_level_is_refused() -> None:
    with pytest.raises(ConfigError, match="session consistency is one of strong"):
        Costs(session_consistency="linearizable")
