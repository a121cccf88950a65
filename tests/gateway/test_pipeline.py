"""The routing pipeline: filters, then the policy; 404 / 503 when nothing fits."""

from __future__ import annotations

from gateway_fakes import view

from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import LeastLoadPolicy, RouteRequest


def pipeline(*views: object) -> RoutingPipeline:
    return RoutingPipeline(InstanceSet(views), LeastLoadPolicy())  # type: ignore[arg-type]


def candidate_ids(p: RoutingPipeline, request: RouteRequest, exclude: tuple[str, ...] = ()
                  ) -> list[str]:
    return [v.instance_id for v in p.candidates(request, exclude)]


def test_filters_keep_only_ready_undrained_unejected_instances_of_the_model() -> None:
    p = pipeline(
        view("a"), view("b", model="other"), view("c", state="starting"),
        view("d", state="draining"), view("e", state="dead"), view("f", is_draining=True),
        view("g", ejected_until=5.0), view("h"),
    )
    assert candidate_ids(p, RouteRequest(model="m")) == ["a", "h"]
    assert candidate_ids(p, RouteRequest(model="m"), exclude=("a",)) == ["h"]
    assert candidate_ids(p, RouteRequest()) == ["a", "b", "h"]  # no model named: any model


def test_version_role_and_pool_filters() -> None:
    p = pipeline(view("a", version="v1"), view("b", version="v2"),
                 view("c", version="v2", pool="gold"), view("d", version="v2", role="prefill"))
    assert candidate_ids(p, RouteRequest(model="m", version="v2")) == ["b", "c"]
    assert candidate_ids(p, RouteRequest(model="m", pool="gold")) == ["c"]
    assert candidate_ids(p, RouteRequest(model="m", role="prefill")) == ["d"]
    assert candidate_ids(p, RouteRequest(model="m")) == ["a", "b", "c"]  # mixed only


def test_route_picks_through_the_policy() -> None:
    p = pipeline(view("a", running=3), view("b", running=1), view("c", model="x"))
    decision = p.route(RouteRequest(model="m"))
    assert decision.instance is not None and decision.instance.instance_id == "b"


def test_unknown_model_is_404_and_known_model_without_capacity_is_503() -> None:
    p = pipeline(view("a", model="m", state="starting"), view("b", model="x"))
    unknown = p.route(RouteRequest(model="nope"))
    assert (unknown.instance, unknown.status_code) == (None, 404)
    assert unknown.reason == "The model `nope` does not exist; models served: m, x"
    busy = p.route(RouteRequest(model="m", version="v9"))
    assert (busy.instance, busy.status_code) == (None, 503)
    assert busy.reason == "no instance is available for model `m` (version v9); retry later"
    tried = p.route(RouteRequest(model="x"), exclude=("b",))
    assert tried.status_code == 503
    assert "that has not already failed" in tried.reason
