"""One request through a real gateway to a simulated instance, over real sockets, with tracing
on: the client's `traceparent` starts one trace, and the gateway's path steps, its routing
decision and attempt, the instance's request and the engine's phases hang from it as one tree."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from live_fleet import ServedApp, serve_app
from live_server import wait_until
from sim_instances import SimInstance, start_sim_instance
from span_tree import (
    CLIENT_SPAN_ID,
    CLIENT_TRACE_ID,
    TRACEPARENT,
    Spans,
    ancestors,
    orphans,
    parent_of,
    trace_ids,
)

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.sources import StaticSource

pytestmark = pytest.mark.timeout(60)
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "tell me about the sea"}],
        "max_tokens": 7, "temperature": 0}
GATEWAY_SPAN = "strata.gateway /v1/chat/completions"
INSTANCE_SPAN = "strata.instance /v1/chat/completions"


@pytest.fixture
def served(spans: Spans) -> Iterator[tuple[SimInstance, ServedApp]]:
    instance = start_sim_instance()
    config = GatewayConfig(instance_urls=(instance.url,), policy="round_robin")
    control = httpx.AsyncClient(timeout=1.0)
    gateway = serve_app(create_gateway_app(config, StaticSource(config.instance_urls, control),
                                           control_client=control))
    yield instance, gateway
    gateway.stop()
    instance.stop()


def traced_chat(gateway: ServedApp, request_id: str) -> httpx.Response:
    """The chat request under the client's sampled `traceparent`, answered 200."""
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT,
                        headers={"traceparent": TRACEPARENT, "x-request-id": request_id},
                        timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def test_a_request_is_one_trace_from_the_client_through_the_gateway_to_the_engine(
        spans: Spans, served: tuple[SimInstance, ServedApp]) -> None:
    _, gateway = served
    answer = traced_chat(gateway, "req-traced")
    # the instance's span ends once its answer is sent, a moment after the client has it
    assert wait_until(lambda: {GATEWAY_SPAN, INSTANCE_SPAN} <= spans.names())
    got = spans.all()
    assert trace_ids(got) == {CLIENT_TRACE_ID}
    assert orphans(got, CLIENT_SPAN_ID) == []
    by_name = {s.name: s for s in got}
    assert {"strata.gateway.step.Admit", "strata.gateway.admission_wait", "strata.gateway.route",
            "strata.gateway.attempt", "strata.engine.request", "strata.engine.queue_wait",
            "strata.engine.prefill_chunk", "strata.engine.decode"} <= set(by_name)
    root = by_name[GATEWAY_SPAN]
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN_ID
    assert root.attributes is not None and root.attributes["strata.request_id"] == "req-traced"
    assert root.attributes["http.response.status_code"] == 200
    # the path, read from the engine's decode up to the client's span
    assert ancestors(by_name["strata.engine.decode"], got) == [
        "strata.engine.request", INSTANCE_SPAN, "strata.gateway.attempt",
        "strata.gateway.step.Admit", "strata.gateway.step.MeterTenants", GATEWAY_SPAN]
    route = by_name["strata.gateway.route"]
    assert parent_of(route, got) is by_name["strata.gateway.step.Admit"]
    assert route.attributes is not None and route.attributes["strata.route.policy"] == \
        "round_robin"
    assert str(route.attributes["strata.route.reason"]).startswith("round_robin chose")
    attempt = by_name["strata.gateway.attempt"].attributes
    assert attempt is not None and attempt["strata.attempt.number"] == 0
    assert attempt["strata.attempt.outcome"] == "answered"
    # the engine's numbers are the answer's
    usage = answer.json()["usage"]
    engine = by_name["strata.engine.request"].attributes
    assert engine is not None and engine["strata.engine.num_output_tokens"] == \
        usage["completion_tokens"] == 7
    assert engine["strata.engine.num_prompt_tokens"] == usage["prompt_tokens"]
    assert engine["strata.engine.finish"] == "finished_length"
    decode = by_name["strata.engine.decode"].attributes
    assert decode is not None and decode["strata.engine.num_tokens"] == 7
    chunk = by_name["strata.engine.prefill_chunk"].attributes
    assert chunk is not None and chunk["strata.engine.num_tokens"] == usage["prompt_tokens"]


def test_the_dashboard_links_a_slow_request_to_its_trace(
        spans: Spans, served: tuple[SimInstance, ServedApp]) -> None:
    _, gateway = served
    traced_chat(gateway, "req-slow")
    data = httpx.get(f"{gateway.url}/dashboard/data", timeout=10).json()  # keyless: the admin's
    [slow] = data["slow_requests"]
    assert (slow["request_id"], slow["trace_id"]) == ("req-slow", f"{CLIENT_TRACE_ID:032x}")
    assert data["trace_url"] is None  # no --trace-url: the page shows the id to look up
