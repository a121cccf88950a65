"""Parent-based sampling at an app's door (`TraceRequests` on a one-route app, through httpx's
ASGI transport): the caller's sampled `traceparent` is followed whatever the ratio, an unsampled
one is followed too (nothing recorded), and a request with none is sampled at the ratio."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from span_tree import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT, Spans
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from strata import tracing

UNSAMPLED = TRACEPARENT[:-2] + "00"


async def echo(request: Request) -> JSONResponse:
    """Answers with the traceparent an upstream call made here would carry, and whether a span
    made here would be a no-op (a dropped trace's)."""
    with tracing.span("strata.test.inner") as inner:
        return JSONResponse({**dict(tracing.inject([])), "inner": inner is not None})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({})


def traced_app() -> Starlette:
    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"]),
                            Route("/health", health, methods=["POST"])])
    app.add_middleware(tracing.TraceRequests, component="strata.test",
                       traced_prefixes=("/v1/",))
    return app


@pytest.fixture(params=[0.0, 1.0], ids=["ratio-0", "ratio-1"])
def sampled_at(request: pytest.FixtureRequest) -> Iterator[tuple[float, Spans]]:
    exporter = InMemorySpanExporter()
    config = tracing.TracingConfig("http://127.0.0.1:4318", sample_ratio=request.param)
    provider = tracing.tracer_provider(config, exporter)
    tracing.start(provider)
    yield request.param, Spans(exporter, provider)
    tracing.stop()


def post(path: str, headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=traced_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, headers=headers)

    return asyncio.run(go())


def test_a_sampled_caller_is_followed_whatever_the_ratio(
        sampled_at: tuple[float, Spans]) -> None:
    _, spans = sampled_at
    onward = post("/v1/completions", {"traceparent": TRACEPARENT}).json()
    inner, span = sorted(spans.all(), key=lambda s: s.name != "strata.test.inner")
    assert span.name == "strata.test /v1/completions" and onward["inner"]
    assert inner.parent is not None and inner.parent.span_id == span.context.span_id  # type: ignore[union-attr]
    assert span.context is not None and span.context.trace_id == CLIENT_TRACE_ID
    assert span.parent is not None and span.parent.span_id == CLIENT_SPAN_ID
    # what this app would send on names the current span, sampled, in the caller's trace
    assert onward["traceparent"] == f"00-{CLIENT_TRACE_ID:032x}-{inner.context.span_id:016x}-01"  # type: ignore[union-attr]


def test_an_unsampled_caller_is_followed_too(sampled_at: tuple[float, Spans]) -> None:
    _, spans = sampled_at
    onward = post("/v1/completions", {"traceparent": UNSAMPLED}).json()
    assert spans.all() == [] and not onward["inner"]  # no span is made in a dropped trace
    assert onward["traceparent"].startswith(f"00-{CLIENT_TRACE_ID:032x}-")
    assert onward["traceparent"].endswith("-00")  # the decision goes on downstream


def test_a_request_without_a_caller_is_sampled_at_the_ratio(
        sampled_at: tuple[float, Spans]) -> None:
    ratio, spans = sampled_at
    post("/v1/completions", {})
    post("/health", {})  # not a traced path
    assert sorted(s.name for s in spans.all()) == (
        ["strata.test /v1/completions", "strata.test.inner"] if ratio else [])
