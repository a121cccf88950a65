"""Priority classes end to end over real sockets: simulated instances in two pools behind a real
gateway with `--class-pool interactive=fast --instance-slots 2`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from gateway_fakes import FixedSource, view
from live_fleet import ServedApp, serve_app

from strata.gateway.app import create_gateway_app
from strata.gateway.config import AdmissionConfig, ClassConfig, GatewayConfig
from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine

# 10 ms a decode step: a 30-token answer takes about 0.3 s
PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=1.0,
                         prefill_ms_per_token=0.01, decode_ms_base=10.0, decode_ms_per_seq=0.1)
POOLS = {"fast-0": "fast", "bulk-0": "bulk", "bulk-1": "bulk"}
IN_FLIGHT = 'strata:gateway_class_in_flight{{class="{1}",pool="{0}"}}'
QUEUED = 'strata:gateway_class_queued{{class="{0}"}}'


@dataclass
class SimFleet:
    instances: dict[str, ServedApp]
    gateway: ServedApp

    def stop(self) -> None:
        for app in (self.gateway, *self.instances.values()):
            app.stop()


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[SimFleet]:
    instances = {}
    for name in POOLS:
        engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
            PROFILE, max_num_seqs=8, kv_blocks=512, max_model_len=512))
        instances[name] = serve_app(create_app(engine, tokenizer, ServerConfig(
            served_model_name="sim", simulated=True)))
    views = [view(name, "sim", pool=pool) for name, pool in POOLS.items()]
    for v in views:
        v.url = instances[v.instance_id].url
    config = GatewayConfig(
        admission=AdmissionConfig(batch_max_queue=2, queue_timeout_s=30.0),
        classes=ClassConfig(class_pools=(("interactive", "fast"),), instance_slots=2))
    gateway = serve_app(create_gateway_app(config, FixedSource(*views)))
    fleet = SimFleet(instances, gateway)
    yield fleet
    fleet.stop()


async def ask(client: httpx.AsyncClient, priority: str, max_tokens: int = 300
              ) -> tuple[int, str]:
    """(status, instance that answered). 300 tokens hold a slot about 3 s: long enough that
    the story's steps, each waiting for the gateway to show the last one, run while it is held."""
    answer = await client.post("/v1/completions", headers={"x-priority": priority}, json={
        "model": "sim", "prompt": "the world", "max_tokens": max_tokens, "ignore_eos": True})
    return answer.status_code, answer.headers.get("x-strata-instance", "")


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's metric samples, by the sample's name and labels."""
    text = (await client.get("/metrics")).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def until(client: httpx.AsyncClient, wanted: dict[str, float],
                timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until the gateway's metrics show `wanted` (a correctness wait, never a judge of
    speed); returns them."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = await gauges(client)
        if all(found.get(name, 0.0) == value for name, value in wanted.items()):
            return found
        seen = {name: found.get(name) for name in wanted}
        assert asyncio.get_running_loop().time() < deadline, f"wanted {wanted}, saw {seen}"
        await asyncio.sleep(0.01)


def routed(found: dict[str, float]) -> float:
    """Attempts the gateway has sent to instances, all instances together."""
    return sum(v for k, v in found.items()
               if k.startswith("strata:gateway_routing_decisions_total{"))


def test_each_class_goes_to_its_pool_and_saturation_sheds_the_low_classes_first(
        sim_fleet: SimFleet) -> None:
    async def story() -> None:
        async with httpx.AsyncClient(base_url=sim_fleet.gateway.url, timeout=60) as client:
            status, where = await ask(client, "interactive", 2)
            assert (status, where) == (200, "fast-0")
            status, where = await ask(client, "standard", 2)
            assert (status, where[:5]) == (200, "bulk-")
            # 6 batch requests fill bulk (2 x 2 slots) and spill into the idle fast pool (2)
            batch = [asyncio.create_task(ask(client, "batch")) for _ in range(6)]
            await until(client, {IN_FLIGHT.format("bulk", "batch"): 4,
                                 IN_FLIGHT.format("fast", "batch"): 2})
            queued = [asyncio.create_task(ask(client, "batch")) for _ in range(2)]
            full = await until(client, {QUEUED.format("batch"): 2})
            retry_after = (await client.post("/v1/completions", headers={
                "x-priority": "sheddable"}, json={"model": "sim", "prompt": "x"})).headers
            assert retry_after["retry-after"] == "1"
            refused = [await ask(client, "batch", 2), await ask(client, "sheddable", 2)]
            assert refused == [(429, ""), (429, "")]
            # no wait and no I/O behind a refusal: nothing was sent to any instance, nothing
            # joined the queue, and the requests it refused for still hold their slots
            after = await gauges(client)
            assert routed(after) == routed(full)
            assert after[QUEUED.format("batch")] == 2
            assert not any(t.done() for t in batch + queued)
            urgent = await ask(client, "interactive", 2)  # batch in fast does not count
            assert urgent == (200, "fast-0")
            done = await asyncio.gather(*batch, *queued)
            assert [d[0] for d in done] == [200] * 8
            assert sorted(d[1] for d in done[:6]).count("fast-0") == 2
            shed = await client.post("/v1/completions", headers={"x-priority": "sheddable"},
                                     json={"model": "sim", "prompt": "x", "max_tokens": 1})
            assert shed.status_code == 200  # room again: sheddable is served when it fits
            text = (await client.get("/metrics")).text
            assert 'strata:gateway_class_shed{class="sheddable"} 2.0' in text
            assert 'strata:gateway_class_shed{class="batch"} 1.0' in text
            assert 'strata:gateway_class_queued{class="batch"} 0.0' in text

    asyncio.run(story())


def test_a_refusal_says_when_to_retry_and_a_bad_priority_is_a_400(sim_fleet: SimFleet) -> None:
    answer = httpx.post(f"{sim_fleet.gateway.url}/v1/completions",
                        headers={"x-priority": "bogus"}, json={"model": "sim", "prompt": "x"})
    assert answer.status_code == 400 and "interactive" in answer.json()["error"]["message"]
