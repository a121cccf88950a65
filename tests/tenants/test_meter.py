"""The tenants' meter in process, on a manual clock: a stream's usage read from its frames as
they pass (untouched, the inner frames closed however it ends); the /metrics series bounded to
the top N tenants and models with the rest in "other"; OpenAI's header forms; `since` parsed or
refused; and a store that fails lets requests through unmetered, counted as an error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.responses import Response

from strata.clock import ManualClock
from strata.errors import InvalidRequestError, UsageStoreError
from strata.gateway.control.usage import parse_since
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.tenants.budgets import Budgets, over_budget, rate_limit_headers
from strata.gateway.tenants.meter import MeterTenants
from strata.gateway.tenants.metrics import TenantMetrics
from strata.gateway.tenants.usage import StreamTap, counts_of_body
from strata.gateway.upstream.proxy import ProxyRequest
from strata.protocol.budgets import KeyLimits
from strata.protocol.keys import TENANT_HEADER
from strata.state.usage import Counts, MemoryUsageStore, Window

USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
         "prompt_tokens_details": {"cached_tokens": 8}}


def frame(payload: object) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def test_a_stream_s_usage_chunk_is_read_as_it_passes_and_the_frames_are_closed() -> None:
    chunks = [frame({"choices": [{"delta": {"content": '"usage": {'}}], "usage": None}),
              frame({"choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"]
    closed: list[bool] = []
    seen: list[Counts] = []

    async def frames() -> AsyncIterator[bytes]:
        try:
            for chunk in chunks:
                yield chunk
        finally:
            closed.append(True)

    async def done(tap: StreamTap) -> None:
        seen.append(tap.counts)

    async def relay(limit: int) -> list[bytes]:
        out = []
        relayed = StreamTap().relay(frames(), done)
        async for chunk in relayed:
            out.append(chunk)
            if len(out) == limit:
                break
        await relayed.aclose()
        return out

    assert asyncio.run(relay(2)) == chunks  # untouched
    assert seen == [Counts(requests=1, prompt_tokens=11, cached_tokens=8, completion_tokens=4)]
    assert asyncio.run(relay(1)) == chunks[:1]  # the client left: no usage, still counted
    assert seen[1] == Counts(requests=1) and closed == [True, True]
    broken = StreamTap()
    broken.see(frame({"error": {"message": "the stream broke"}}))
    assert broken.counts == Counts(requests=1, errors=1)


def test_whole_answers_count_their_usage_or_their_error() -> None:
    assert counts_of_body(200, json.dumps({"usage": USAGE}).encode()) == (
        Counts(requests=1, prompt_tokens=11, cached_tokens=8, completion_tokens=4), True)
    assert counts_of_body(200, b"not json") == (Counts(requests=1), False)
    assert counts_of_body(503, b"{}") == (Counts(requests=1, errors=1), False)


def test_metrics_keep_the_top_tenants_and_models_and_fold_the_rest() -> None:
    registry = CollectorRegistry()
    meter = TenantMetrics(registry, top_tenants=2, top_models=1)
    meter.add("big", "m1", Counts(requests=1, prompt_tokens=100))
    meter.add("mid", "m1", Counts(requests=1, completion_tokens=50))
    meter.add("small", "m1", Counts(requests=1, completion_tokens=1))
    meter.add("tiny", "m2", Counts(requests=2, errors=1))
    assert meter.bounded() == {
        ("big", "m1"): Counts(requests=1, prompt_tokens=100),
        ("mid", "m1"): Counts(requests=1, completion_tokens=50),
        ("other", "m1"): Counts(requests=1, completion_tokens=1),
        ("other", "other"): Counts(requests=2, errors=1)}
    text = generate_latest(registry).decode()
    assert 'strata:gateway_tenant_requests_total{model="other",tenant="other"} 2.0' in text
    assert ('strata:gateway_tenant_tokens_total{kind="prompt",model="m1",tenant="big"} 100.0'
            in text)


def test_headers_and_the_429_in_openai_s_forms() -> None:
    limits = KeyLimits(requests_per_min=10, tokens_per_min=1000)
    assert rate_limit_headers(limits, Window(True, 4, 250, 17.25)) == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "6",
        "x-ratelimit-reset-requests": "17.2s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "750", "x-ratelimit-reset-tokens": "17.2s"}
    refused = over_budget(KeyLimits(tokens_per_min=1000), Window(False, 9, 1040, 0.42))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-reset-tokens"] == "420ms"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert "x-ratelimit-limit-requests" not in refused.headers
    assert json.loads(bytes(refused.body))["error"]["message"] == (
        "Rate limit reached for this API key: 1000 tokens per minute; retry after 420ms")


def test_since_is_epoch_seconds_an_iso_time_or_an_age() -> None:
    now = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    assert parse_since(None, now) == now - 3600
    assert parse_since("1799999000", now) == 1799999000.0
    assert parse_since("15m", now) == now - 900
    assert parse_since("2027-01-15T06:00:00Z", now) == now - 7200
    assert parse_since("2027-01-15T06:00:00", now) == now - 7200  # no zone: UTC
    assert parse_since("2027-01-15T07:00:00+01:00", now) == now - 7200
    for bad in ("", "soon", "15 minutes", "-1h", "1800000001", "nan", "inf"):
        with pytest.raises(InvalidRequestError, match="^since: "):
            parse_since(bad, now)


class FailingStore(MemoryUsageStore):
    async def take(self, tenant: str, *, max_requests: int | None,
                   max_tokens: int | None) -> Window:
        raise UsageStoreError("redis usage store redis://x: connection refused")

    async def add(self, tenant: str, model: str, counts: Counts) -> None:
        raise UsageStoreError("redis usage store redis://x: connection refused")


def test_a_failing_store_lets_requests_through_unmetered_and_counts_it() -> None:
    store, metrics = FailingStore(clock=ManualClock(60.0)), GatewayMetrics()
    meter = MeterTenants(store, Budgets(store, {"t": KeyLimits(requests_per_min=1)}),
                         TenantMetrics(metrics.registry), metrics)
    request = ProxyRequest("POST", "/v1/chat/completions", b"{}", [(TENANT_HEADER, "t")],
                           RouteRequest(model="m"), 0.0)

    async def answer(_: ProxyRequest) -> Response:
        return Response(json.dumps({"usage": USAGE}), 200)

    for _ in range(2):  # over its 1 rpm, had the store answered
        response = asyncio.run(meter(request, answer))
        assert response.status_code == 200 and "x-ratelimit-limit-requests" not in response.headers
    assert metrics.errors.labels("usage_store")._value.get() == 4  # take and add, twice
    assert meter.tenants.counts[("t", "m")].requests == 2  # /metrics still counts
