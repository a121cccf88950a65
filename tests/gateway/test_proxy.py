"""The gateway app over scripted upstreams (httpx.MockTransport): routing, retries before the
first byte, broken streams, aggregation, drain."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, sse_answer, view

from strata.gateway.app import create_gateway_app
from strata.gateway.config import AdmissionConfig, GatewayConfig, RetryConfig
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.recovery import Recovery
from strata.gateway.wiring import Gateway
from strata.protocol.sse import parse_events

CONFIG = GatewayConfig(policy="round_robin", retry=RetryConfig(max_retries=2, backoff_base_s=0.0))
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": []}


def call(upstreams: Upstreams, views: list[InstanceView], requests: list[tuple[str, str, Any]],
         config: GatewayConfig = CONFIG) -> tuple[list[httpx.Response], Gateway]:
    """Runs `requests` (method, path, json body) through a gateway app, in order."""
    app = create_gateway_app(config, FixedSource(*views), transport=upstreams.transport(),
                             clock=FakeClock(), run_background=False)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return [await client.request(m, p, content=_body(b)) for m, p, b in requests]

    return asyncio.run(run()), app.state.gateway


def _body(body: Any) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    return json.dumps(body).encode()


def completion(request: httpx.Request) -> httpx.Response:
    return json_answer(COMPLETION | {"echo": json.loads(request.content)})


def test_bodies_are_forwarded_untouched_and_answers_name_their_instance() -> None:
    upstreams = Upstreams(a=completion, b=completion)
    body = b'{"model": "m",   "prompt": "hi", "extra_field": [1, 2]}'
    responses, _ = call(upstreams, [view("a"), view("b")],
                        [("POST", "/v1/completions", body)] * 3)
    assert [r.headers["x-strata-instance"] for r in responses] == ["a", "b", "a"]
    assert responses[0].json()["echo"] == json.loads(body)
    assert upstreams.calls == [("a", "/v1/completions"), ("b", "/v1/completions"),
                               ("a", "/v1/completions")]


def test_a_refused_connection_is_retried_on_another_instance() -> None:
    upstreams = Upstreams(b=completion)  # a refuses connections
    responses, gateway = call(upstreams, [view("a"), view("b")],
                              [("POST", "/v1/chat/completions", {"model": "m"})])
    assert responses[0].status_code == 200
    assert responses[0].headers["x-strata-instance"] == "b"
    assert upstreams.calls == [("a", "/v1/chat/completions"), ("b", "/v1/chat/completions")]
    assert gateway.source.instances.get("a").consecutive_failures == 1  # type: ignore[union-attr]
    assert _metric(gateway, "strata:gateway_retries_total") == 1.0
    assert gateway.source.instances.get("a").num_in_flight == 0  # type: ignore[union-attr]


def test_when_every_attempt_fails_the_last_5xx_answer_is_passed_through() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        return json_answer({"error": {"message": f"engine dead on {request.url.host}"}}, 503)

    upstreams = Upstreams(a=broken, b=broken, c=broken)
    responses, gateway = call(upstreams, [view("a"), view("b"), view("c")],
                              [("POST", "/v1/completions", {"model": "m"})])
    assert responses[0].status_code == 503
    assert responses[0].json()["error"]["message"] == "engine dead on b"
    # 1 try + max_retries=2, each on an instance not tried yet (round robin over the rest)
    assert [h for h, _ in upstreams.calls] == ["a", "c", "b"]


def test_repeated_failures_eject_an_instance_and_traffic_moves_away() -> None:
    upstreams = Upstreams(b=completion)
    views = [view("a"), view("b")]
    config = GatewayConfig(policy="round_robin", retry=RetryConfig(max_retries=0))
    requests = [("POST", "/v1/completions", {"model": "m"})] * 8
    responses, gateway = call(upstreams, views, requests, config)
    assert [r.status_code for r in responses] == [502, 200, 502, 200, 502, 200, 200, 200]
    assert views[0].is_ejected
    assert _metric(gateway, "strata:gateway_ejections_total", instance="a") == 1.0
    assert responses[0].json()["error"]["type"] == "upstream_error"


def test_a_stream_that_breaks_after_its_first_frame_ends_with_an_error_event_and_done() -> None:
    frames = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\ndata: {"n"', b': 3}']  # dies mid-frame
    upstreams = Upstreams(a=lambda r: sse_answer(*frames, breaks=True))
    responses, gateway = call(upstreams, [view("a")],
                              [("POST", "/v1/completions", {"model": "m", "stream": True})])
    events = list(parse_events([responses[0].content]))
    assert events[:2] == ['{"n": 1}', '{"n": 2}']  # the partial third frame is dropped
    assert json.loads(events[2])["error"]["type"] == "upstream_error"
    assert "RemoteProtocolError" in json.loads(events[2])["error"]["message"]
    assert events[3:] == ["[DONE]"]
    assert _metric(gateway, "strata:gateway_broken_streams_total") == 1.0
    assert gateway.admission.num_in_flight == 0


def test_a_stream_that_breaks_before_its_first_frame_is_retried() -> None:
    upstreams = Upstreams(a=lambda r: sse_answer(b'data: {"n"', breaks=True),
                          b=lambda r: sse_answer(b'data: {"n": 1}\n\n', b"data: [DONE]\n\n"))
    responses, _ = call(upstreams, [view("a"), view("b")],
                        [("POST", "/v1/completions", {"model": "m", "stream": True})])
    assert responses[0].headers["x-strata-instance"] == "b"
    assert list(parse_events([responses[0].content])) == ['{"n": 1}', "[DONE]"]


def test_models_are_aggregated_over_routable_instances_each_once() -> None:
    views = [view("a", model="m"), view("b", model="m"), view("c", model="x"),
             view("d", model="y", state="starting")]
    responses, _ = call(Upstreams(), views, [("GET", "/v1/models", None), ("GET", "/ready", None)])
    assert [card["id"] for card in responses[0].json()["data"]] == ["m", "x"]
    assert responses[1].json() == {"status": "ready", "num_routable": 3}


def test_a_models_card_is_deterministic_only_when_every_routable_instance_of_it_is() -> None:
    views = [view("a", model="d", deterministic=True), view("b", model="d", deterministic=True),
             view("c", model="d", state="starting"),  # not routable: does not count
             view("e", model="m"), view("f", model="m", deterministic=True)]
    responses, _ = call(Upstreams(), views, [("GET", "/v1/models", None)])
    assert responses[0].json()["data"] == [
        {"id": "d", "object": "model", "owned_by": "strata", "deterministic": True},
        {"id": "m", "object": "model", "owned_by": "strata", "deterministic": False}]


def test_unknown_model_bad_json_and_no_instance_answers() -> None:
    requests = [("POST", "/v1/completions", {"model": "nope"}),
                ("POST", "/v1/completions", b"{not json"),
                ("POST", "/v1/completions", {"model": "m", "max_tokens": "9"}),
                ("GET", "/ready", None)]
    responses, _ = call(Upstreams(), [view("a", state="starting")], requests)
    assert [r.status_code for r in responses] == [404, 400, 400, 503]
    assert responses[0].json()["error"]["type"] == "not_found_error"
    assert responses[2].json()["error"]["message"] == "max_tokens: has the wrong type (str)"
    assert responses[3].headers["retry-after"] == "1"


def test_drain_stops_routing_at_once_and_asks_the_instance_to_drain() -> None:
    upstreams = Upstreams(a=completion, b=lambda r: json_answer({"status": "draining"}, 202))
    views = [view("a"), view("b")]
    responses, _ = call(upstreams, views, [
        ("POST", "/admin/instances/b/drain", None),
        ("POST", "/admin/instances/zz/drain", None),
        ("POST", "/v1/completions", {"model": "m"}),
        ("POST", "/v1/completions", {"model": "m"}),
        ("GET", "/admin/instances", None),
    ])
    assert responses[0].status_code == 202
    assert responses[0].json() == {"instance_id": "b", "draining": True, "instance_status": 202}
    assert responses[1].status_code == 404
    assert [r.headers["x-strata-instance"] for r in responses[2:4]] == ["a", "a"]
    listed = {i["instance_id"]: i for i in responses[4].json()["instances"]}
    assert (listed["b"]["draining"], listed["b"]["routable"]) == (True, False)
    assert ("b", "/admin/drain") in upstreams.calls


def _metric(gateway: Gateway, name: str, **labels: str) -> float | None:
    value = gateway.metrics.registry.get_sample_value(name, labels or None)
    return value



def test_a_gateway_with_api_keys_checks_them_before_routing() -> None:
    config = GatewayConfig(api_keys=("secret",))
    app = create_gateway_app(config, FixedSource(view("a")), transport=Upstreams().transport(),
                             run_background=False)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return [(await client.get("/v1/models")).status_code,
                    (await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
                     ).status_code,
                    (await client.get("/health")).status_code]

    assert asyncio.run(run()) == [401, 200, 200]


def test_an_unexpected_transport_error_is_the_instance_failing_not_a_500() -> None:
    """A transport that raises what httpx does not wrap (a pool closed under a request raises
    RuntimeError) fails that attempt: retried elsewhere, never an internal error."""
    def closed(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("Cannot send a request, as the client has been closed.")

    upstreams = Upstreams(a=closed, b=completion)
    responses, gateway = call(upstreams, [view("a"), view("b")],
                              [("POST", "/v1/completions", {"model": "m"})])
    assert responses[0].status_code == 200 and responses[0].headers["x-strata-instance"] == "b"
    assert _metric(gateway, "strata:gateway_retries_total") == 1.0
    short_wait = dataclasses.replace(CONFIG, admission=AdmissionConfig(start_wait_s=0.2))
    only_a, _ = call(Upstreams(a=closed), [view("a")], [("POST", "/v1/completions", {"m": 1})],
                     short_wait)  # its only instance never comes back: 502 after the wait
    assert only_a[0].status_code == 502 and "RuntimeError" in only_a[0].json()["error"]["message"]


def test_an_odd_error_of_a_connection_reset_as_it_opens_is_retried_never_a_500() -> None:
    """anyio asks a socket the peer already reset for its name: AttributeError, not an
    httpx error (seen under the chaos suite's resets)."""

    def reset(request: httpx.Request) -> httpx.Response:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    upstreams = Upstreams(a=reset, b=completion)
    responses, gateway = call(upstreams, [view("a"), view("b")],
                              [("POST", "/v1/completions", {"model": "m"})])
    assert responses[0].status_code == 200
    assert responses[0].headers["x-strata-instance"] == "b"
    assert gateway.source.instances.get("a").consecutive_failures == 1  # type: ignore[union-attr]

    async def probe() -> bool:
        await gateway.health.check_once()
        return gateway.source.instances.get("a").is_healthy  # type: ignore[union-attr]

    health_app = create_gateway_app(CONFIG, FixedSource(view("a")),
                                    transport=Upstreams(a=reset).transport(),
                                    run_background=False)
    gateway = health_app.state.gateway
    assert asyncio.run(probe()) is False


def _served_once_b_is_back(upstreams: Upstreams, views: list[InstanceView]
                           ) -> tuple[httpx.Response, Gateway, int]:
    """Send a completion; once the gateway waits for its fleet (or answered: the bug), note the
    upstream calls so far, let "b" restart and pass a health check, and return the answer, the
    gateway and the calls made before the wait."""
    app = create_gateway_app(CONFIG, FixedSource(*views), transport=upstreams.transport(),
                             clock=FakeClock(), run_background=False)
    gateway: Gateway = app.state.gateway
    recovery = gateway.proxy.recovery
    assert recovery is not None

    async def run() -> tuple[httpx.Response, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            waiting = asyncio.create_task(client.post("/v1/completions", json={"model": "m"}))
            for _ in range(500):  # bounded: the request waits, or it was answered
                if recovery.num_waits or waiting.done():
                    break
                await asyncio.sleep(0.01)
            assert not waiting.done(), (await waiting).text
            num_calls = len(upstreams.calls)
            upstreams.hosts["b"] = completion  # b restarted ...
            gateway.proxy.detector.clock.advance(1.0)  # type: ignore[attr-defined]
            b = next(v for v in views if v.instance_id == "b")
            gateway.proxy.detector.record_health(b, is_healthy=True)  # ... and is seen
            return await waiting, num_calls

    answer, num_calls = asyncio.run(run())
    return answer, gateway, num_calls


def test_a_fleet_that_is_down_holds_the_request_until_an_instance_is_back() -> None:
    """Every instance of the model refuses connections (killed, restarting): the request does
    not get a 502; it waits until an instance passes a health check again, and is served.
    One whose fleet never comes back gets its 502 after the start wait."""
    upstreams = Upstreams()  # a and b refuse: both processes are down
    answer, gateway, num_calls = _served_once_b_is_back(upstreams, [view("a"), view("b")])
    assert num_calls == 2  # both tried, then waits
    assert answer.status_code == 200 and answer.headers["x-strata-instance"] == "b"
    assert gateway.proxy.recovery.num_recovered == 1  # type: ignore[union-attr]


def test_an_instance_that_cannot_take_the_request_does_not_hide_a_fleet_that_is_down() -> None:
    """The whole-fleet test's 502: every decode instance of a P/D fleet was restarting while the
    prefill instance was already back. The prefill instance is up but can take no whole request,
    so the request's fleet is down and the request waits for a decode instance, as above."""
    upstreams = Upstreams(p=completion)  # a and b (decode) refuse; p (prefill) is up
    views = [view("a", role="decode"), view("b", role="decode"), view("p", role="prefill")]
    answer, _, _ = _served_once_b_is_back(upstreams, views)
    assert answer.status_code == 200 and answer.headers["x-strata-instance"] == "b"
    assert [call for call in upstreams.calls if call[0] == "p"] == []


def test_a_version_restarting_is_an_outage_though_another_version_serves() -> None:
    """After a flip to v2, v1's instances stay up (retiring, or kept for pinned sessions), but a
    request decided for v2 cannot take them: while v2's only instance restarts, the request
    waits for it (bench/whole_fleet.py at 10x load got three 503s "no instance is available
    for model `tiny` (version v2)" during its release before). Once it is back, it is not."""
    instances = InstanceSet()
    instances.add(view("v1", version="v1"))
    restarting = view("v2", version="v2", state="dead")
    instances.add(restarting)
    recovery = Recovery(instances, 60.0)
    assert recovery.is_down(RouteRequest(model="m", version="v2"), ())
    assert not recovery.is_down(RouteRequest(model="m", version="v1"), ())
    assert not recovery.is_back(RouteRequest(model="m", version="v2"), 0.0, {"v1", "v2"})
    restarting.state, restarting.healthy_at = "ready", 1.0
    assert recovery.is_back(RouteRequest(model="m", version="v2"), 0.0, {"v1", "v2"})
    assert not recovery.is_down(RouteRequest(model="m", version="v2"), ())


def test_a_version_whose_instances_leave_is_not_an_outage_while_another_serves() -> None:
    """A canary rolled back: its instance drains while the live version serves. A request that
    was decided for the canary is not held for --start-wait-s (the release e2e's read timeouts
    once recovery judged the fleet by version too); a whole model down still is."""
    instances = InstanceSet()
    instances.add(view("live", version="v2"))
    instances.add(view("canary", version="v3", is_draining=True))
    recovery = Recovery(instances, 60.0)
    assert not recovery.is_down(RouteRequest(model="m", version="v3"), ())
    assert recovery.is_down(RouteRequest(model="m", version="v3"), ("live",))
