"""The gateway and an instance's deadline answer, over real sockets: an instance that answers
504 `deadline_exceeded` (x-should-retry: false) before the gateway's own clock runs out is
relayed as it is, never retried on another instance nor counted as the instance's failure."""

from __future__ import annotations

import json

import httpx
from gateway_fakes import FixedSource
from live_fleet import serve_app
from live_server import metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.instances import InstanceView
from strata.protocol.errors import error_json


def late_instance(calls: list[str], name: str) -> Starlette:
    """Answers every completion with its deadline's 504 (its clock ran out first)."""

    async def completions(request: Request) -> Response:
        calls.append(name)
        body = error_json(504, "late", kind="timeout_error", code="deadline_exceeded")
        return Response(body, 504, media_type="application/json",
                        headers={"x-should-retry": "false"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_an_instances_deadline_answer_is_relayed_not_retried() -> None:
    calls: list[str] = []
    instances = [serve_app(late_instance(calls, name)) for name in ("a", "b")]
    app = create_gateway_app(GatewayConfig(policy="round_robin"),
                             FixedSource(*(InstanceView(n, i.url, "m")
                                           for n, i in zip("ab", instances, strict=True))),
                             run_background=False)
    gateway = serve_app(app)
    try:
        r = httpx.post(f"{gateway.url}/v1/completions", json={"model": "m", "prompt": "hi"},
                       headers={"X-Strata-Timeout-S": "30"}, timeout=30)
        assert r.status_code == 504
        assert json.loads(r.content)["error"]["code"] == "deadline_exceeded"
        assert len(calls) == 1  # not retried on the other instance
        assert metric(gateway.url, "gateway_retries_total") == 0
        assert metric(gateway.url, "gateway_requests_cancelled_total", reason="deadline") == 1
        assert metric(gateway.url, "gateway_upstream_failures_total", instance=calls[0]) == 0
    finally:
        gateway.stop()
        for instance in instances:
            instance.stop()
