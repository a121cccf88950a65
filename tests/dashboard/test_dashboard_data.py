"""The dashboard over an in-process gateway: what it serves and to whom, and the snapshot it
draws, on an injected clock with fake instances (the browser tests run the real thing)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view
from starlette.applications import Starlette

import strata.gateway
from strata.autoscale.status import AutoscalerStatus, ScalingTarget
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.control.dashboard.page import (
    ASSETS,
    CONTENT_SECURITY_POLICY,
    HIDDEN,
    dashboard_routes,
)
from strata.gateway.routes import build_routes
from strata.gateway.routing.instances import ReportedLoad
from strata.gateway.routing.sources import RegistrySource
from strata.gateway.wiring import build_gateway
from strata.protocol.keys import tenant_of_key
from strata.protocol.lora import AdapterResidency
from strata.registry.instances.memory import MemoryRegistry
from strata.registry.instances.records import InstanceRecord, InstanceState
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    Strategy,
)
from strata.registry.models.memory import MemoryModelRegistry

STATIC = Path(strata.gateway.__file__).parent / "control" / "dashboard" / "static"


def calls(app: Any, *requests: tuple[str, str, dict[str, str]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return [await client.request(method, path, headers=headers)
                    for method, path, headers in requests]

    return asyncio.run(run())


def keyed_app(keys: tuple[str, ...]) -> Any:
    return create_gateway_app(GatewayConfig(api_keys=keys), FixedSource(view("a")),
                              transport=Upstreams().transport(), clock=FakeClock(),
                              run_background=False)


def test_the_page_and_its_files_come_from_the_gateway_under_a_strict_policy() -> None:
    app = keyed_app(())
    page, *assets = calls(app, ("GET", "/dashboard", {}),
                          *(("GET", f"/dashboard/static/{name}", {}) for name in ASSETS))
    [missing] = calls(app, ("GET", "/dashboard/static/secrets.txt", {}))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "https:" not in CONTENT_SECURITY_POLICY and "*" not in CONTENT_SECURITY_POLICY
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(linked) == sorted(f"/dashboard/static/{name}" for name in ASSETS)
    for name, answer in zip(ASSETS, assets, strict=True):
        assert answer.status_code == 200, name
        assert answer.headers["content-type"] == ASSETS[name]
        assert answer.content == (STATIC / name).read_bytes()
    assert missing.status_code == 404


def test_nothing_shipped_names_another_host_and_uplot_is_the_pinned_release() -> None:
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}", (STATIC / name).read_text()), name
    chart_js = (STATIC / "uPlot.iife.min.js").read_text()
    assert chart_js.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    assert re.findall(r"https?://", chart_js) == ["https://"]  # that first comment only
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()


def test_with_api_keys_the_data_takes_one_and_a_client_key_reads_it_only() -> None:
    key = {"authorization": "Bearer k1"}
    page, anonymous, wrong, client, asset, unknown, drain, listing = calls(
        keyed_app(("k0", "k1")), ("GET", "/dashboard", {}), ("GET", "/dashboard/data", {}),
        ("GET", "/dashboard/data", {"authorization": "Bearer nope"}),
        ("GET", "/dashboard/data", key), ("GET", "/dashboard/static/dashboard.js", {}),
        ("GET", "/dashboard/static/other.js", {}), ("POST", "/admin/instances/a/drain", key),
        ("GET", "/admin/instances", {}))
    assert page.status_code == 200 and asset.status_code == 200  # the page asks for a key
    assert [anonymous.status_code, wrong.status_code] == [401, 401]
    assert client.json()["access"] == {"admin": False, "keyed": True}
    [row] = client.json()["instances"]  # read-only, not blind: but its address is hidden
    assert row["status"] == "ready" and row["url"] == HIDDEN
    assert row["instance_id"].startswith("instance-")  # "a" is its address (http://a)
    assert [r.status_code for r in (unknown, drain, listing)] == [404, 403, 401]


def test_a_gateway_without_keys_has_an_open_admin_api_and_says_so() -> None:
    [data] = calls(keyed_app(()), ("GET", "/dashboard/data", {}))
    assert data.json()["access"] == {"admin": True, "keyed": False}
    assert data.headers["cache-control"] == "no-store"


def dashboard(clock: FakeClock, models: MemoryModelRegistry | None = None,
              instances: MemoryRegistry | None = None,
              autoscaler: Callable[[], Any] | None = None) -> Any:
    """The gateway's routes and the dashboard's over instances a, b (from `instances` when
    given); a and b answer completions and their /metrics."""
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text='strata:prefix_cache_hit_rate{model_name="m"} 0.5\n')
        return json_answer({"choices": [{"text": "ok"}]})

    upstreams = Upstreams(a=answer, b=answer)
    source: Any = (RegistrySource(instances) if instances is not None
                   else FixedSource(view("a", version="v1"), view("b", version="v2")))
    gateway = build_gateway(GatewayConfig(), source, transport=upstreams.transport(),
                            clock=clock, models=models, instance_registry=instances)
    app = Starlette(routes=[*build_routes(), *dashboard_routes(gateway, clock=clock,
                                                                autoscaler=autoscaler)])
    app.state.gateway = gateway
    return app, gateway


def test_answers_proxied_through_the_gateway_reach_the_charts() -> None:
    clock = FakeClock(5000.0)
    app, gateway = dashboard(clock)

    async def story() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for _ in range(3):
                answer = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert answer.status_code == 200
            clock.advance(1.0)
            return (await client.get("/dashboard/data")).json()

    data = asyncio.run(story())
    assert data["series"]["t"][-1] == 5000
    assert data["series"]["answers_per_s"][-1] == 3
    assert data["series"]["failures_per_s"][-1] == 0
    assert data["series"]["ttft_ms_mean"][-1] is not None
    assert [i["prefix_hit_rate"] for i in data["instances"]] == [0.5, 0.5]
    assert data["caches"]["prefix_hit_rate_mean"] == 0.5


def test_the_snapshot_tells_each_instance_s_condition_and_heartbeat_age() -> None:
    clock = FakeClock(7000.0)
    instances = MemoryRegistry(ttl_s=5.0, clock=clock)

    async def story() -> dict[str, Any]:
        for iid, state in (("a", InstanceState.READY), ("b", InstanceState.STARTING)):
            await instances.register(InstanceRecord(iid, f"http://{iid}", "m", "v1",
                                                    state=state, simulated=True,
                                                    node=f"node-{iid}"))
        clock.advance(2.5)
        app, gateway = dashboard(clock, instances=instances)
        await gateway.source.refresh()
        gateway.source.instances.get("a").is_healthy = False
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return (await client.get("/dashboard/data")).json()

    rows = {r["instance_id"]: r for r in asyncio.run(story())["instances"]}
    assert {iid: (r["status"], r["heartbeat_age_s"], r["simulated"], r["routable"])
            for iid, r in rows.items()} == {"a": ("unhealthy", 2.5, True, True),
                                            "b": ("starting", 2.5, True, False)}
    assert rows["a"]["load"] == {"num_in_flight": 0, "num_running": 0, "num_waiting": 0,
                                 "kv_usage": 0.0}
    assert [rows[iid]["node"] for iid in "ab"] == ["node-a", "node-b"]


def test_models_show_their_parts_replicas_and_newest_release() -> None:
    clock = FakeClock(100.0)
    models = MemoryModelRegistry(clock=clock)
    release = Release("r1", "m", "v2", "v1", strategy=Strategy.BLUE_GREEN, replicas=2,
                      state=ReleaseState.WARMING, created_at=100.0,
                      history=(("pending", 100.0), ("starting", 100.5), ("warming", 103.0)))

    async def story() -> dict[str, Any]:
        for version in ("v1", "v2"):
            await models.add_version(ModelVersion("m", version, f"sim:{version}"))
        await models.set_routing(ModelRouting("m", live="v1", previous="v0"),
                                 expected_revision=0)
        await models.put_deployment(Deployment("m", "v1", 1), expected_revision=0)
        await models.put_deployment(Deployment("m", "v2", 2), expected_revision=0)
        await models.put_deployment(Deployment("m", "v0", 1, DeploymentState.RETIRING),
                                    expected_revision=0)
        await models.put_release(release, expected_revision=0)
        app, _ = dashboard(clock, models=models)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return (await client.get("/dashboard/data")).json()

    data = asyncio.run(story())
    [model] = data["models"]
    assert model["routing"]["live"] == "v1" and model["routing"]["previous"] == "v0"
    assert [(v["version"], v["part"], v["desired_replicas"], v["num_routable"], v["uri"])
            for v in model["versions"]] == [("v1", "live", 1, 1, "sim:v1"),
                                             ("v2", None, 2, 1, "sim:v2")]
    [shown] = data["releases"]
    assert (shown["release_id"], shown["state"], shown["is_terminal"]) == ("r1", "warming", False)
    assert [(s["state"], s["status"], s["entered_at"]) for s in shown["steps"]] == [
        ("pending", "passed", 100.0), ("starting", "passed", 100.5),
        ("warming", "current", 103.0), ("flipping", "ahead", None),
        ("retiring", "ahead", None), ("done", "ahead", None)]
    assert data["control"] == {"drain": True, "releases": False}  # no instance registry
    assert data["autoscaler"] is None and data["errors"] == []


def test_an_autoscaler_fills_its_own_field() -> None:
    status = AutoscalerStatus(decided_at=42.0, owner="autoscaler-1", targets=(
        ScalingTarget("m", "v1", "decode", "default", desired=4, actual=3,
                      reason="queue above target"),))

    async def report() -> AutoscalerStatus:
        return status

    app, _ = dashboard(FakeClock(), autoscaler=report)
    [data] = calls(app, ("GET", "/dashboard/data", {}))
    assert data.json()["autoscaler"] == {
        "decided_at": 42.0, "owner": "autoscaler-1",
        "targets": [{"model": "m", "version": "v1", "role": "decode", "pool": "default",
                     "desired": 4, "actual": 3, "reason": "queue above target"}]}


def test_an_autoscaler_that_fails_leaves_its_field_empty_and_says_why() -> None:
    async def broken() -> AutoscalerStatus:
        raise RuntimeError("lease store down")

    app, _ = dashboard(FakeClock(), autoscaler=broken)
    [data] = calls(app, ("GET", "/dashboard/data", {}))
    assert data.json()["autoscaler"] is None
    assert data.json()["errors"] == ["autoscaler: RuntimeError: lease store down"]
    assert [i["instance_id"] for i in data.json()["instances"]] == ["a", "b"]


def test_tenants_show_their_usage_to_the_admin_and_a_client_its_own_row_only() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return json_answer({"choices": [{"text": "ok", "finish_reason": "length"}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                      "total_tokens": 7}})

    app = create_gateway_app(GatewayConfig(api_keys=("k0", "k1"), admin_keys=("adm",)),
                             FixedSource(view("a")), transport=Upstreams(a=answer).transport(),
                             clock=FakeClock(), run_background=False)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for key in ("k0", "k0", "k1"):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                                      headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            return [await client.get("/dashboard/data",
                                     headers={"authorization": f"Bearer {key}"})
                    for key in ("adm", "k1")]

    admin, client = asyncio.run(run())
    k0, k1 = tenant_of_key("k0"), tenant_of_key("k1")
    rows = admin.json()["tenants"]["rows"]
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in rows] == [(k0, 2, 10, 4), (k1, 1, 5, 2)]  # most tokens first
    assert admin.json()["tenants"]["window_s"] == 900
    assert [r["tenant"] for r in client.json()["tenants"]["rows"]] == [k1]  # its own only
    slow = admin.json()["slow_requests"]  # tracing is off here: ids, no trace ids
    assert len(slow) == 3 and {s["trace_id"] for s in slow} == {None}
    assert all(s["request_id"] and s["instance_id"] == "a" for s in slow)
    assert client.json()["slow_requests"] == []  # other tenants' request ids: the admin's


def test_adapters_show_k_share_and_residency_with_adapter_aware_only() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return json_answer({"choices": [{"text": "ok"}]})

    known = {"sql": AdapterResidency("sql", "d1", num_loads=2, num_evictions=1, load_s=0.05),
             "chat": AdapterResidency("chat")}
    a, b = view("a"), view("b")
    a.reported = ReportedLoad(adapters=known)
    b.reported = ReportedLoad(adapters={"sql": AdapterResidency("sql")})
    clock = FakeClock(100.0)
    gateway = build_gateway(GatewayConfig(policy="adapter_aware"), FixedSource(a, b),
                            transport=Upstreams(a=answer, b=answer).transport(), clock=clock)
    app = Starlette(routes=[*build_routes(), *dashboard_routes(gateway, clock=clock)])
    app.state.gateway = gateway

    async def story() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            routed = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
            assert routed.status_code == 200  # an adapter name routes through the gateway
            return (await client.get("/dashboard/data")).json()

    assert asyncio.run(story())["adapters"] == [
        {"adapter": "sql", "replicas": 1, "share": round(1 / 64, 4), "num_instances": 2,
         "num_resident": 1, "num_loads": 2, "num_evictions": 1, "load_s": 0.05},
        {"adapter": "chat", "replicas": 1, "share": 0.0, "num_instances": 1,
         "num_resident": 0, "num_loads": 0, "num_evictions": 0, "load_s": 0.0}]
    _, plain = dashboard(FakeClock())
    assert plain.adapters is None  # another policy: the field stays null
