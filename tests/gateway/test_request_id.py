"""The gateway hands each request's X-Request-Id to the instance: the client's when sane, else
one it made, and answers with the same id."""

from __future__ import annotations

import asyncio

import httpx
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.protocol.request_id import is_sane


def test_the_gateway_forwards_the_clients_id_or_the_one_it_made() -> None:
    seen: list[str | None] = []

    def instance(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return json_answer({"id": "cmpl-1", "choices": []})

    app = create_gateway_app(GatewayConfig(policy="round_robin"), FixedSource(view("a")),
                             transport=Upstreams(a=instance).transport(), clock=FakeClock(),
                             run_background=False)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            body = {"model": "m", "prompt": "hi"}
            return [await client.post("/v1/completions", json=body, headers=headers)
                    for headers in ({"X-Request-Id": "from-client"}, {}, {"X-Request-Id": "a b"})]

    given, made, replaced = asyncio.run(run())
    assert given.headers["x-request-id"] == seen[0] == "from-client"
    assert made.headers["x-request-id"] == seen[1] and is_sane(seen[1] or "")
    assert replaced.headers["x-request-id"] == seen[2] != "a b"
    assert len(set(seen)) == 3
