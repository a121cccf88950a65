"""The gateway's control-plane admin API: every refusal is a clear OpenAI error body."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from gateway_fakes import FakeClock, FixedSource, Upstreams, view

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.registry import create_model_registry, create_registry


def _app(with_registry: bool = True) -> Any:
    models = create_model_registry("memory://") if with_registry else None
    instances = create_registry("memory://") if with_registry else None
    return create_gateway_app(GatewayConfig(), FixedSource(view("a", version="v1")),
                              transport=Upstreams().transport(), clock=FakeClock(),
                              run_background=False, models=models, instance_registry=instances)


def _calls(app: Any, *requests: tuple[str, str, Any]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            out = []
            for method, path, body in requests:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                out.append(await client.request(method, path, **kw))
            return out

    return asyncio.run(run())


def _error(r: httpx.Response, status: int, text: str) -> None:
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]


def test_a_gateway_without_a_model_registry_says_how_to_get_one() -> None:
    [r] = _calls(_app(with_registry=False), ("GET", "/admin/models", None))
    _error(r, 400, "--registry sqlite:///")


def test_models_are_added_once_and_listed_with_their_instances() -> None:
    v1 = {"name": "m", "version": "v1", "uri": "sim:smollm2-cpu"}
    added, again, conflict, listing = _calls(
        _app(), ("POST", "/admin/models", v1), ("POST", "/admin/models", v1),
        ("POST", "/admin/models", v1 | {"uri": "sim:elsewhere"}), ("GET", "/admin/models", None))
    assert added.status_code == 201 and added.json()["uri"] == "sim:smollm2-cpu"
    assert again.status_code == 201  # the same record again: nothing changes
    assert conflict.status_code == 409
    assert conflict.json()["error"]["type"] == "conflict_error"
    [model] = listing.json()["models"]
    assert (model["name"], model["routing"]) == ("m", None)
    assert [(v["version"], v["routable_instances"]) for v in model["versions"]] == [
        ("v1", ["a"])]


def test_bad_requests_are_400_and_unknown_things_404() -> None:
    bad_json, missing, no_version, unknown, strategy, no_release, no_previous = _calls(
        _app(), ("POST", "/admin/models", b"{nope"),
        ("POST", "/admin/models", {"name": "m", "version": "v1"}),
        ("POST", "/admin/releases", {"model": "m"}),
        ("POST", "/admin/releases", {"model": "m@v9"}),
        ("POST", "/admin/releases", {"model": "m@v9", "strategy": "red-black"}),
        ("GET", "/admin/releases/nope", None),
        ("POST", "/admin/models/m/rollback", None))
    _error(bad_json, 400, "not valid JSON")
    _error(missing, 400, "missing field 'uri'")
    _error(no_version, 400, "NAME@VERSION")
    assert unknown.status_code == 404 and "v9" in unknown.json()["error"]["message"]
    _error(strategy, 400, "red-black")
    _error(no_release, 404, "no release 'nope'")
    _error(no_previous, 400, "no previous version")
