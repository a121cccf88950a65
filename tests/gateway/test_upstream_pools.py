"""The per-instance upstream pools over real instance servers (uvicorn on 127.0.0.1): one pool per
instance, kept across requests, retired when the instance leaves or changes URL, closed only once
nothing is in flight there, and all closed at shutdown."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from gateway_fakes import FixedSource
from live_fleet import ServedApp, serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from strata.gateway.config import GatewayConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.connection import ConnectionPool
from strata.gateway.upstream.pools import RelayResponse, UpstreamPools
from strata.gateway.upstream.proxy import ProxyRequest
from strata.gateway.wiring import Gateway, build_gateway

CONFIG = GatewayConfig(policy="round_robin")


def instance_app(name: str, gate: threading.Event) -> Starlette:
    """Answers with its name and the gateway's source port (same port: connection reused); a
    stream's second frame waits for `gate`."""

    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        port = request.client.port if request.client else 0
        if not (await request.json()).get("stream"):
            return JSONResponse({"instance": name, "port": port})

        async def frames() -> AsyncIterator[bytes]:
            yield f"data: {json.dumps({'instance': name})}\n\n".encode()
            while not gate.is_set():
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def served() -> Iterator[tuple[list[ServedApp], threading.Event]]:
    gate = threading.Event()
    apps = [serve_app(instance_app(name, gate)) for name in ("a", "b")]
    yield apps, gate
    gate.set()
    for app in apps:
        app.stop()


def gateway_for(apps: list[ServedApp]) -> Gateway:
    views = [InstanceView(name, app.url, "m") for name, app in zip("ab", apps, strict=False)]
    gateway = build_gateway(CONFIG, FixedSource(*views))
    gateway.proxy.prune_interval_s = 0.0  # prune before every attempt
    return gateway


def request(*, is_stream: bool = False) -> ProxyRequest:
    body = json.dumps({"model": "m", "prompt": "hi", "stream": is_stream}).encode()
    return ProxyRequest("POST", "/v1/completions", body, [("content-type", "application/json")],
                        RouteRequest(model="m", is_stream=is_stream), time.perf_counter())


async def answer(gateway: Gateway) -> dict[str, object]:
    response = await gateway.proxy.forward(request())
    assert response.status_code == 200
    return json.loads(bytes(response.body))


def connections(pools: UpstreamPools, instance_id: str) -> int:
    return open_connections(pools.pools[instance_id].transport)


def open_connections(transport: object) -> int:
    """The connections a pool holds (idle or in use)."""
    assert isinstance(transport, ConnectionPool)
    return transport.num_connections


def test_each_instance_gets_its_own_pool_whose_connection_is_reused(served) -> None:
    apps, _ = served
    gateway = gateway_for(apps)

    async def run() -> list[dict[str, object]]:
        try:
            return [await answer(gateway) for _ in range(4)]
        finally:
            await gateway.close()

    pools = gateway.proxy.upstreams
    answers = asyncio.run(run())
    assert [a["instance"] for a in answers] == ["a", "b", "a", "b"]
    assert answers[0]["port"] == answers[2]["port"]  # one kept-alive connection per instance
    assert answers[1]["port"] == answers[3]["port"]
    assert answers[0]["port"] != answers[1]["port"]
    assert pools.pools == {} and pools.retired == []  # closed at shutdown


def test_a_departed_instance_keeps_its_pool_until_its_stream_ends(served) -> None:
    apps, gate = served
    gateway = gateway_for(apps)
    pools = gateway.proxy.upstreams

    async def run() -> None:
        try:
            stream = await gateway.proxy.forward(request(is_stream=True))  # to a
            assert isinstance(stream, RelayResponse)
            frames = stream.body_iterator
            assert b'"instance": "a"' in await anext(frames)
            gone = pools.pools["a"]
            gateway.source.instances.remove("a")
            assert (await answer(gateway))["instance"] == "b"  # prunes: a retired, not closed
            assert "a" not in pools.pools and pools.retired == [gone]
            gate.set()
            assert [rest async for rest in frames] == [b"data: [DONE]\n\n"]  # not cut
            assert (await answer(gateway))["instance"] == "b"  # prunes: a closed now
            await asyncio.gather(*pools._closing)  # the close runs in the background
            assert pools.retired == [] and connections(pools, "b") == 1
            assert open_connections(gone.transport) == 0
        finally:
            await gateway.close()

    asyncio.run(run())


def test_an_instance_that_changes_url_gets_a_new_pool(served) -> None:
    apps, _ = served
    gateway = gateway_for(apps[:1])
    pools = gateway.proxy.upstreams
    gateway.source.instances.remove("b")

    async def run() -> None:
        try:
            first = await answer(gateway)
            old = pools.pools["a"]
            view = gateway.source.instances.get("a")
            assert view is not None
            view.url = apps[1].url  # the record now names the other server
            assert (await answer(gateway))["port"] != first["port"]
            assert pools.pools["a"] is not old and pools.retired == []
            assert pools.pools["a"].url == apps[1].url
        finally:
            await gateway.close()

    asyncio.run(run())
