"""An instance in the registry: registered READY with its load, heartbeats, drains, leaves."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from live_server import MODEL_NAME, wait_until
from registered_server import start_registered

from strata.errors import ConfigError
from strata.model.loader import LoadedModel
from strata.registry import (
    InstanceLoad,
    InstanceRecord,
    InstanceState,
    Registry,
    Role,
    create_registry,
)
from strata.registry.instances.memory import MemoryRegistry
from strata.server.async_engine import AsyncEngine
from strata.server.registration import Registration, build_registration


def lookup(registry: Registry, instance_id: str = "inst-a") -> InstanceRecord | None:
    """Read a registry from the test thread (the server's loop owns the memory registry)."""
    return asyncio.run(registry.get(instance_id))


def state_of(registry: Registry, instance_id: str = "inst-a") -> InstanceState | None:
    record = lookup(registry, instance_id)
    return None if record is None else record.state


def test_instance_registers_heartbeats_drains_and_leaves(tiny_model: LoadedModel) -> None:
    def make(url: str, engine: AsyncEngine) -> Registration:
        return build_registration("memory://", instance_id="inst-a", advertise_url=url,
                                  model=MODEL_NAME, async_engine=engine, version="v1",
                                  role="mixed", pool="p1", interval_s=0.05)

    srv = start_registered(tiny_model, make)
    registry, url = srv.registration.registry, srv.base_url
    try:
        assert wait_until(lambda: state_of(registry) is InstanceState.READY)
        record = lookup(registry)
        assert record is not None
        assert (record.url, record.model, record.version, record.role, record.pool) == \
            (url, MODEL_NAME, "v1", Role.MIXED, "p1")
        first_beat = record.last_heartbeat
        assert wait_until(lambda: lookup(registry).last_heartbeat > first_beat)  # type: ignore

        srv.gate.hold(allow=1)  # the first token comes out, then the stream stays in flight
        body: list[str] = []
        stream = threading.Thread(target=lambda: body.append(_stream_completion(url)))
        stream.start()
        assert wait_until(lambda: srv.gate.num_blocked == 2)  # step 1 passed, step 2 is held
        load = httpx.get(f"{url}/load").json()
        assert (load["num_in_flight"], load["num_running"] + load["num_waiting"],
                load["draining"]) == (1, 1, False)
        assert wait_until(lambda: lookup(registry).load.num_in_flight == 1)  # type: ignore

        drain = httpx.post(f"{url}/admin/drain")
        assert (drain.status_code, drain.json()) == (202, {"status": "draining",
                                                           "num_in_flight": 1})
        assert wait_until(lambda: state_of(registry) is InstanceState.DRAINING)
        refused = httpx.post(f"{url}/v1/completions",
                             json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
        assert httpx.get(f"{url}/ready").status_code == 503
        assert httpx.get(f"{url}/load").json()["draining"] is True
        assert state_of(registry) is InstanceState.DRAINING  # still listed while in flight

        srv.gate.open()
        stream.join(timeout=30)
        assert body[0].rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in body[0]
        assert wait_until(lambda: lookup(registry) is None)
        assert httpx.get(f"{url}/health").status_code == 200  # drained, not dead
    finally:
        srv.stop()


def _stream_completion(url: str) -> str:
    request = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "stream": True,
               "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=60) as resp:
        assert resp.status_code == 200
        return "".join(resp.iter_text())


def test_server_shutdown_deregisters_from_a_shared_sqlite_file(tiny_model: LoadedModel,
                                                                tmp_path: Path) -> None:
    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"

    def make(url: str, engine: AsyncEngine) -> Registration:
        return build_registration(registry_url, instance_id="inst-b", advertise_url=url + "/",
                                  model=MODEL_NAME, async_engine=engine, pool="p2",
                                  interval_s=0.05, deterministic=True)

    observer = create_registry(registry_url)  # another process's view of the same file
    srv = start_registered(tiny_model, make)
    try:
        assert wait_until(lambda: state_of(observer, "inst-b") is InstanceState.READY)
        record = lookup(observer, "inst-b")
        assert record is not None and (record.url, record.pool, record.deterministic) == \
            (srv.base_url, "p2", True)  # what the gateway's GET /v1/models reports per model
    finally:
        srv.stop()
    assert lookup(observer, "inst-b") is None
    asyncio.run(observer.close())


class FlakyRegistry(MemoryRegistry):
    """Fails the first `num_failures` calls of any kind, as an unreachable backend would."""

    def __init__(self, num_failures: int) -> None:
        super().__init__()
        self.num_failures = num_failures
        self.num_calls = 0

    def _maybe_fail(self) -> None:
        self.num_calls += 1
        if self.num_calls <= self.num_failures:
            raise ConnectionError("registry unreachable")

    async def register(self, record: InstanceRecord) -> None:
        self._maybe_fail()
        await super().register(record)

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        self._maybe_fail()
        await super().heartbeat(instance_id, state=state, load=load)


RECORD = InstanceRecord("inst-c", "http://127.0.0.1:9", "tiny")


async def _until(predicate: object, num_polls: int = 2000) -> bool:
    for _ in range(num_polls):
        if predicate():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.005)
    return False


def test_registry_outages_are_retried_and_a_lost_record_is_registered_again() -> None:
    async def story() -> list[InstanceState | None]:
        registry = FlakyRegistry(num_failures=3)
        loads = iter(range(1000))
        registration = Registration(registry, RECORD, interval_s=0.005,
                                    load_fn=lambda: InstanceLoad(num_running=next(loads)))
        registration.start()
        seen: list[InstanceState | None] = []
        assert await _until(lambda: registration.is_registered)
        seen.append((await registry.get("inst-c")).state)  # type: ignore[union-attr]
        await registry.deregister("inst-c")  # e.g. a registry reset
        assert await _until(lambda: registry._records.get("inst-c") is not None)
        await registration.stop()
        await registration.stop()
        seen.append(await registry.get("inst-c"))  # type: ignore[arg-type]
        assert registry.num_calls > 4
        return seen

    assert asyncio.run(story()) == [InstanceState.READY, None]


def test_starting_until_ready_and_drain_wins_over_ready() -> None:
    async def story() -> list[InstanceState]:
        registry = MemoryRegistry()
        is_ready = False

        async def ready() -> bool:
            return is_ready

        registration = Registration(registry, RECORD, interval_s=0.005,
                                    load_fn=InstanceLoad, ready_fn=ready)
        registration.start()
        states = []
        assert await _until(lambda: registration.is_registered)
        states.append((await registry.get("inst-c")).state)  # type: ignore[union-attr]
        is_ready = True
        assert await _until(lambda: registry._records["inst-c"].state is InstanceState.READY)
        await registration.drain()
        states.append((await registry.get("inst-c")).state)  # type: ignore[union-attr]
        await asyncio.sleep(0.05)  # later heartbeats keep DRAINING
        states.append((await registry.get("inst-c")).state)  # type: ignore[union-attr]
        await registration.stop()
        return states

    assert asyncio.run(story()) == [InstanceState.STARTING, InstanceState.DRAINING,
                                    InstanceState.DRAINING]


def test_build_registration_refuses_an_unknown_role() -> None:
    with pytest.raises(ConfigError, match="unknown role 'gpu'; use one of: mixed, prefill"):
        build_registration("memory://", instance_id="x", advertise_url="http://h:1",
                           model="m", async_engine=None, role="gpu")  # type: ignore[arg-type]
