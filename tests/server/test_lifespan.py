"""The app's lifespan: the parts it opens at startup and the order it closes them at shutdown.

A simulated engine (no torch) and recording fakes at the registry and store boundaries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from strata.registry import InstanceLoad, InstanceRecord, InstanceState
from strata.registry.instances.memory import MemoryRegistry
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.instance import Instance
from strata.server.registration import Registration, engine_load
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine
from strata.state.kv_store import KVItem
from strata.state.sessions import SessionStore, create_session_store
from strata.types import BlockHash

PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.2,
                         prefill_ms_per_token=0.001, decode_ms_base=0.5, decode_ms_per_seq=0.05)
NAME = "sim-model"


def engine_state(engine: AsyncEngine) -> str:
    return "engine up" if engine.is_healthy else "engine down"


class RecordingRegistry(MemoryRegistry):
    """A memory registry that logs each write with the engine's state at that moment."""

    def __init__(self, engine: AsyncEngine, events: list[str]) -> None:
        super().__init__()
        self.engine, self.events = engine, events

    async def register(self, record: InstanceRecord) -> None:
        self.events.append(f"register {record.state.value}, {engine_state(self.engine)}")
        await super().register(record)

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        assert state is not None
        self.events.append(f"heartbeat {state.value}, {engine_state(self.engine)}")
        await super().heartbeat(instance_id, state=state, load=load)

    async def deregister(self, instance_id: str) -> None:
        self.events.append(f"deregister, {engine_state(self.engine)}")
        await super().deregister(instance_id)


class EmptyKVStore:
    """Holds no block; logs its close with the engine's state."""

    def __init__(self, engine: AsyncEngine, events: list[str]) -> None:
        self.engine, self.events = engine, events

    async def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        return []

    async def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        return 0

    async def put_many(self, items: Sequence[KVItem]) -> int:
        return 0

    async def close(self) -> None:
        self.events.append(f"KV store closed, {engine_state(self.engine)}")


class LoggedSessionStore:
    """A memory session store whose close is logged (it must not be: the caller owns it)."""

    def __init__(self, events: list[str]) -> None:
        self.inner: SessionStore = create_session_store("memory://")
        self.events = events

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def close(self) -> None:
        self.events.append("session store closed")


def test_shutdown_drains_stops_the_engine_deregisters_then_closes_the_stores() -> None:
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        PROFILE, kv_blocks=64, max_model_len=256, namespace=f"{NAME}@default"))
    events: list[str] = []
    registry = RecordingRegistry(async_engine, events)
    registration = Registration(registry, InstanceRecord("inst-a", "http://127.0.0.1:1", NAME),
                                interval_s=3600.0, load_fn=engine_load(async_engine))
    sessions = LoggedSessionStore(events)
    config = ServerConfig(served_model_name=NAME, simulated=True, kv_offload=True,
                          kv_store_url="memory://", shutdown_timeout_s=5.0)
    app = create_app(async_engine, tokenizer, config, registration=registration,
                     session_store=sessions,  # type: ignore[arg-type]
                     kv_store=EmptyKVStore(async_engine, events))
    instance: Instance = app.state.instance

    async def run() -> None:
        async with app.router.lifespan_context(app):
            assert instance.sessions is not None and instance.sessions.store is sessions
            assert instance.serving.kv_offload is not None
            while not registration.is_registered:  # its first beat, on the lifespan's loop
                await asyncio.sleep(0.01)
            assert not instance.is_draining and async_engine.is_healthy
        assert instance.is_draining

    asyncio.run(run())
    assert events == [
        "register ready, engine up",
        "heartbeat draining, engine up",  # new requests refused, in-flight ones still run
        "deregister, engine down",
        "KV store closed, engine down",  # pending publishes had until now; no session close
    ]
