"""The gateway's GET /v1/models over real sockets says `deterministic` per model: true only when
every routable instance of the model is (a request may land on any of them). From the registry's
records, and from a static instance's own card (a simulated instance says false)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from live_fleet import serve_app, serve_gateway
from sim_instances import start_sim_instance

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.sources import RegistrySource
from strata.registry import InstanceRecord, InstanceState, create_registry


def _card(model: str, deterministic: bool) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "strata", "deterministic": deterministic}


def test_registry_records_make_a_model_deterministic_only_when_all_routable_ones_are() -> None:
    registry = create_registry("memory://", ttl_s=60.0)
    source = RegistrySource(registry, InstanceSet())
    records = [("d-0", "d", True, InstanceState.READY), ("d-1", "d", True, InstanceState.READY),
               ("d-2", "d", False, InstanceState.STARTING),  # not routable: does not count
               ("m-0", "m", False, InstanceState.READY), ("m-1", "m", True, InstanceState.READY)]

    async def fill() -> None:
        for iid, model, deterministic, state in records:
            await registry.register(InstanceRecord(iid, f"http://{iid}", model, state=state,
                                                   deterministic=deterministic))
        await source.refresh()

    asyncio.run(fill())
    # no background refresh or health checks: the records' URLs serve nothing
    gateway = serve_app(create_gateway_app(GatewayConfig(), source, run_background=False))
    try:
        cards = httpx.get(f"{gateway.url}/v1/models", timeout=5.0).json()["data"]
        assert cards == [_card("d", True), _card("m", False)]
    finally:
        gateway.stop()


def test_a_simulated_instance_behind_a_static_gateway_is_not_deterministic() -> None:
    instance = start_sim_instance(model="sim")
    gateway = serve_gateway(["--instances", instance.url])
    try:
        deadline = time.monotonic() + 10.0
        cards: list[dict[str, Any]] = []
        while not cards and time.monotonic() < deadline:
            cards = httpx.get(f"{gateway.url}/v1/models", timeout=5.0).json()["data"]
            time.sleep(0.05)
        assert cards == [_card("sim", False)]
    finally:
        gateway.stop()
        instance.stop()
