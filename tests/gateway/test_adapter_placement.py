"""`adapter_aware` placement stories on fake fleet views with an injected clock: a rare adapter
has one home; k grows with an adapter's demand and shrinks with hysteresis; the bounded load
holds under one hot adapter, which never floods the fleet; an instance leaving moves only the
adapters it was home to; a request goes to a home that holds the adapter, a full home spills to
an instance that holds it, and a home at the cap for a moment keeps it under the averaged
bound. And the seam: the pipeline serves adapter names that instances report, /metrics shows k
and residency."""

from __future__ import annotations

import math

import pytest
from gateway_fakes import FakeClock
from live_fleet import gateway_config

from strata.errors import ConfigError
from strata.gateway.config import AdapterPlacementConfig
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.routing.adapter_metrics import AdapterMetrics
from strata.gateway.routing.instances import InstanceSet, InstanceView, ReportedLoad
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import AdapterAwarePolicy, create_policy
from strata.gateway.routing.policies.adapter_aware import rendezvous_order
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.load_average import LoadAverages
from strata.protocol.lora import AdapterResidency
from strata.registry.instances.records import InstanceLoad

NAMES = tuple(f"lora-{i}" for i in range(40))
CONFIG = AdapterPlacementConfig(window_s=10.0, spread=2.0, hysteresis=0.25, shrink_after_s=30.0,
                                warm_s=5.0, min_requests=16)


def fleet(n: int, adapters: tuple[str, ...] = NAMES, resident: dict[str, set[str]] | None = None
          ) -> list[InstanceView]:
    """n instances of base model `base` that know `adapters`; `resident[iid]` are held."""
    def report(iid: str) -> ReportedLoad:
        held = (resident or {}).get(iid, set())
        return ReportedLoad(adapters={a: AdapterResidency(a, "d" if a in held else None)
                                      for a in adapters})
    return [InstanceView(f"i{k:02d}", f"http://i{k}", "base", reported=report(f"i{k:02d}"))
            for k in range(n)]


def policy(clock: FakeClock) -> AdapterAwarePolicy:
    return AdapterAwarePolicy(CONFIG, epsilon=0.25, clock=clock)


def route(p: AdapterAwarePolicy, views: list[InstanceView], adapter: str) -> InstanceView:
    """One request for `adapter`, routed and finished at once (no load left behind)."""
    request = RouteRequest(model=adapter)
    view = p.choose(request, views)
    p.on_request_routed(request, view)
    p.on_request_finished(request, view, is_success=True)
    return view


def test_a_rare_adapter_has_one_home_the_first_in_rendezvous_order() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(8)
    homes = {name: {route(p, views, name).instance_id for _ in range(3)} for name in NAMES}
    assert all(len(h) == 1 for h in homes.values())  # k = 1: every request to one instance
    assert {name: p.home(name, views)[0].instance_id for name in NAMES} == \
        {name: h.pop() for name, h in homes.items()}
    per_instance = [sum(p.home(n, views)[0] is v for n in NAMES) for v in views]
    assert min(per_instance) >= 1 and max(per_instance) <= 10  # 40 homes spread over 8


def test_k_grows_with_demand_and_shrinks_only_after_the_hysteresis() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(8)
    for i in range(64):  # 1 request in 4 is for the hot one: share 1/4, k = ceil(2 * 8 / 4)
        route(p, views, "lora-0" if i % 4 == 0 else NAMES[1 + i % 39])
        clock.advance(0.05)
    assert p.demand.share("lora-0") == pytest.approx(0.25, abs=0.03)
    level = p.demand._adapters["lora-0"].level  # the highest share seen: 5 of the first 17
    assert level == pytest.approx(5 / 17, abs=0.01)
    assert p.demand.replicas("lora-0", 8) == math.ceil(2 * 8 * level) == 5
    assert p.demand.replicas("lora-1", 8) == 1
    for i in range(40):  # demand falls to 1 in 16: the band holds k while the countdown runs
        route(p, views, "lora-0" if i % 16 == 0 else NAMES[1 + i % 39])
        clock.advance(0.5)
    assert p.demand.share("lora-0") < 0.25 / 1.25
    assert p.demand.replicas("lora-0", 8) == 5  # 20 s under the band: not yet 30
    for i in range(80):
        route(p, views, "lora-0" if i % 16 == 0 else NAMES[1 + i % 39])
        clock.advance(0.5)
    assert p.demand.replicas("lora-0", 8) < 5  # 30 s under the band: k follows demand down
    assert p.demand.replicas("lora-0", 8) == max(1, math.ceil(
        2 * 8 * p.demand._adapters["lora-0"].level))


def test_a_share_inside_the_band_never_shrinks_k() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(8)
    for i in range(400):  # share 0.4, then 1/3 for 160 s: under the level, inside its band
        hot = i % 10 in (0, 3, 6, 8) if i < 80 else i % 3 == 0
        route(p, views, "lora-0" if hot else "lora-1")
        clock.advance(0.5)
    assert p.demand.share("lora-0") < 0.36 < p.demand._adapters["lora-0"].level / 1.2
    assert p.demand.replicas("lora-0", 8) == 7  # without the band it shrinks to 6 (ceil(5.6))


def test_one_hot_adapter_stays_within_the_bound_and_off_part_of_the_fleet() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(16)
    in_flight = []
    for i in range(160):  # 1 in 5 is the hot adapter; nothing finishes
        request = RouteRequest(model="lora-0" if i % 5 == 0 else NAMES[1 + i % 39])
        view = p.choose(request, views)
        cap = math.ceil(1.25 * (sum(v.request_load for v in views) + 1) / 16)
        assert view.request_load < cap  # the bounded load: max <= ceil((1 + eps) * mean)
        view.num_in_flight += 1
        p.on_request_routed(request, view)
        in_flight.append((request, view))
        clock.advance(0.1)
    loads = [v.num_in_flight for v in views]
    assert max(loads) <= math.ceil(1.25 * 160 / 16)
    hot = {view.instance_id for request, view in in_flight if request.model == "lora-0"}
    k = p.demand.replicas("lora-0", 16)
    assert 4 <= k < 16 and len(hot) < 16  # share 1/5 -> ceil(2 * 16 / 5) = 7; not every one
    assert hot <= {v.instance_id for v in p.home("lora-0", views)} | spill(p, views, "lora-0")


def spill(p: AdapterAwarePolicy, views: list[InstanceView], adapter: str) -> set[str]:
    """The instances after the home set in rendezvous order (where a full home spills)."""
    home = {v.instance_id for v in p.home(adapter, views)}
    return {v.instance_id for v in views} - home


def test_an_instance_leaving_moves_only_the_adapters_it_was_home_to() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(8)
    before = {name: route(p, views, name).instance_id for name in NAMES}
    gone = "i03"
    after = {name: route(p, [v for v in views if v.instance_id != gone], name).instance_id
             for name in NAMES}
    moved = {name for name in NAMES if before[name] != after[name]}
    assert moved == {name for name in NAMES if before[name] == gone} and moved


def test_a_home_that_holds_the_adapter_wins_over_an_idle_one_that_would_load_it() -> None:
    clock = FakeClock()
    p = policy(clock)
    for i in range(64):  # make lora-0 hot enough for two homes or more
        route(p, fleet(4), "lora-0" if i % 2 else "lora-1")
    views = fleet(4)
    home = p.home("lora-0", views)
    assert len(home) >= 2
    warm = home[-1].instance_id
    views = fleet(4, resident={warm: {"lora-0"}})
    p._sent_at.clear()
    clock.advance(CONFIG.warm_s)  # no mark left: only the report says where it is
    for view in views:  # the warm home busier than the others, still under the bound:
        view.num_in_flight = 3 if view.instance_id == warm else 2  # ceil(1.25 * 10 / 4) = 4
    assert p.choose(RouteRequest(model="lora-0"), views).instance_id == warm


def test_a_full_home_spills_to_an_instance_holding_the_adapter_before_a_cold_one() -> None:
    p = policy(FakeClock())
    views = fleet(4)
    order = [v.instance_id for v in rendezvous_order("lora-7", views)]
    assert [v.instance_id for v in p.home("lora-7", views)] == order[:1]
    home, warm = order[0], order[-1]  # k = 1; the last in rendezvous order holds it
    views = fleet(4, resident={warm: {"lora-7"}})
    for view in views:  # the home at the bound: ceil(1.25 * (4 + 1) / 4) = 2
        view.num_in_flight = 2 if view.instance_id == home else (1 if view.instance_id == warm
                                                                 else 0)
    assert p.choose(RouteRequest(model="lora-7"), views).instance_id == warm
    views = fleet(4)  # nobody holds it: the next in rendezvous order
    views[[v.instance_id for v in views].index(home)].num_in_flight = 2
    assert p.choose(RouteRequest(model="lora-7"), views).instance_id == order[1]


class Traffic:
    """Requests sent through the policy's hooks and left in flight until `finish_all`."""

    def __init__(self, p: AdapterAwarePolicy) -> None:
        self.p = p
        self.open: list[tuple[RouteRequest, InstanceView]] = []

    def send(self, view: InstanceView, adapter: str, n: int = 1) -> None:
        for _ in range(n):
            request = RouteRequest(model=adapter)
            view.num_in_flight += 1
            self.p.on_request_routed(request, view)
            self.open.append((request, view))

    def finish_all(self) -> None:
        for request, view in self.open:
            view.num_in_flight -= 1
            self.p.on_request_finished(request, view, is_success=True)
        self.open.clear()


def test_a_home_at_the_cap_for_a_moment_keeps_its_adapter_under_the_averaged_bound() -> None:
    clock = FakeClock()
    p, views = policy(clock), fleet(4)
    traffic = Traffic(p)
    home = p.home("lora-7", views)[0]
    for view in views:  # one request each, 1 s long: the averages' window
        traffic.send(view, "lora-1")
    clock.advance(1.0)
    traffic.finish_all()
    for view in views:  # the others hold 2 requests for 5 s, the home none
        traffic.send(view, "lora-1", 0 if view is home else 2)
    clock.advance(5.0)
    traffic.send(home, "lora-7", 4)  # a burst at the home: at the cap ceil(1.25 * 11 / 4)
    assert home.request_load == 4 == math.ceil(1.25 * 11 / 4)
    assert p.choose(RouteRequest(model="lora-7"), views) is home  # its average is near 0
    p.averages = LoadAverages(clock)  # without the averages: spilled to another instance
    assert p.choose(RouteRequest(model="lora-7"), views) is not home


def test_base_model_requests_go_to_the_least_loaded() -> None:
    p, views = policy(FakeClock()), fleet(3)
    views[0].num_in_flight, views[1].num_in_flight = 2, 1
    assert p.choose(RouteRequest(model="base"), views).instance_id == "i02"


def test_the_pipeline_routes_adapter_names_the_instances_report_and_metrics_show_them() -> None:
    clock = FakeClock()
    p = create_policy("adapter_aware", clock=clock)
    assert isinstance(p, AdapterAwarePolicy)
    views = fleet(4, adapters=("sql", "chat"), resident={"i01": {"sql"}})
    views[1].reported = ReportedLoad(adapters={
        "sql": AdapterResidency("sql", "d1", num_loads=3, num_evictions=2, load_s=0.08),
        "chat": AdapterResidency("chat")})
    instances = InstanceSet(views)
    pipeline = RoutingPipeline(instances, p)
    decision = pipeline.route(RouteRequest(model="sql"))
    assert decision.instance is not None and decision.num_candidates == 4
    pipeline.sent(RouteRequest(model="sql"), decision.instance)
    missing = pipeline.route(RouteRequest(model="poetry"))
    assert missing.status_code == 404 and "base, chat, sql" in missing.reason
    metrics = GatewayMetrics()
    AdapterMetrics(metrics.registry, p, instances)
    sample = metrics.registry.get_sample_value
    assert sample("strata:gateway_adapter_replicas", {"adapter": "sql"}) == 1
    assert sample("strata:gateway_adapter_resident_instances", {"adapter": "sql"}) == 1
    assert sample("strata:gateway_adapter_loads_total", {"adapter": "sql"}) == 3
    assert sample("strata:gateway_adapter_evictions_total", {"adapter": "sql"}) == 2
    assert sample("strata:gateway_adapter_load_seconds", {"adapter": "sql"}) == 0.08
    assert sample("strata:gateway_adapter_share", {"adapter": "sql"}) == 1 / 64


def test_an_unknown_name_among_many_adapters_lists_a_few_and_counts_the_rest() -> None:
    pipeline = RoutingPipeline(InstanceSet(fleet(2)), policy(FakeClock()))
    reason = pipeline.route(RouteRequest(model="poetry")).reason
    assert reason.endswith("base, lora-0, lora-1, lora-10, lora-11, lora-12, lora-13, lora-14, "
                           "lora-15, lora-16, lora-17, lora-18, lora-19, lora-2, lora-20, "
                           "lora-21, lora-22, lora-23, lora-24, lora-25 and 21 more "
                           "(GET /v1/models lists them)")


def test_the_load_report_carries_residency_through_json() -> None:
    load = InstanceLoad(num_running=1, adapters=(AdapterResidency("sql", "ab", 2, 1, 0.05),
                                                 AdapterResidency("chat")))
    assert InstanceLoad.from_json(load.to_json()) == load
    assert "adapters" not in InstanceLoad().to_json()  # a base-only instance: as before


def test_the_cli_builds_the_placement_settings_and_refuses_nonsense() -> None:
    config = gateway_config(["--instances", "http://a", "--policy", "adapter_aware",
                             "--adapter-spread", "3",
                             "--adapter-window-s", "10", "--adapter-shrink-after-s", "20"])
    assert (config.adapters.spread, config.adapters.window_s,
            config.adapters.shrink_after_s) == (3.0, 10.0, 20.0)
    p = create_policy("adapter_aware", config=config)
    assert isinstance(p, AdapterAwarePolicy) and p.config is config.adapters
    with pytest.raises(ConfigError, match="spread must be positive"):
        AdapterPlacementConfig(spread=0)
