"""Tracing off (no --otlp-endpoint, the default): nothing is installed and nothing is recorded.
No tracer provider is set, the apps carry no tracing middleware, the gateway's path is not
wrapped, and the calls left on the path are no-ops."""

from __future__ import annotations

import functools

import httpx
from live_fleet import serve_app
from opentelemetry import trace
from sim_instances import start_sim_instance
from span_tree import TRACEPARENT

from strata import tracing
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.path.forward import TracedStep
from strata.gateway.routing.sources import StaticSource
from strata.tracing.setup import current

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def test_off_by_default_nothing_is_installed_and_no_span_is_made() -> None:
    assert not tracing.is_on() and current.provider is None
    # Strata never sets OpenTelemetry's global provider: it is still the API's placeholder
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    instance = start_sim_instance()
    config = GatewayConfig(instance_urls=(instance.url,))
    control = httpx.AsyncClient(timeout=1.0)
    app = create_gateway_app(config, StaticSource(config.instance_urls, control),
                             control_client=control)
    assert "TraceRequests" not in {m.cls.__name__ for m in app.user_middleware}  # type: ignore
    forward = app.state.gateway.forward
    assert isinstance(forward, functools.partial) and not isinstance(forward.func, TracedStep)
    gateway = serve_app(app)
    try:
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT,
                            headers={"traceparent": TRACEPARENT}, timeout=30)
        assert answer.status_code == 200, answer.text
    finally:
        gateway.stop()
        instance.stop()
    assert not tracing.is_on()  # nothing on the way turned it on
    assert tracing.span("strata.anything").__enter__() is None  # the shared no-op
    assert tracing.inject([("a", "b")]) == [("a", "b")]
