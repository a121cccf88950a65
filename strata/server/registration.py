"""An instance's presence in the registry: register, heartbeat its load, drain, deregister.

    registration = build_registration(registry_url, instance_id=..., advertise_url=..., ...)
    create_app(async_engine, tokenizer, config, registration=registration)

The app's lifespan runs it: the record is registered STARTING, turns READY once the advertised
URL answers /ready (so routers never see an instance they cannot reach), heartbeats every
`interval_s` with the engine's load, turns DRAINING on drain and is deregistered when the drain
completes or the server stops. A registry that cannot be reached is logged and retried; it never
stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from strata.clock import Clock
from strata.errors import ConfigError, RegistryError
from strata.protocol.lora import AdapterResidency
from strata.registry import create_registry
from strata.registry.instances.base import Registry
from strata.registry.instances.records import (
    InstanceLoad,
    InstanceRecord,
    InstanceState,
    RankInfo,
    Role,
)
from strata.server.async_engine import AsyncEngine

log = logging.getLogger("strata.server.registration")
LoadFn = Callable[[], InstanceLoad]
ReadyFn = Callable[[], Awaitable[bool]]


def engine_load(async_engine: AsyncEngine,
                adapters: Callable[[], tuple[AdapterResidency, ...]] | None = None) -> LoadFn:
    """The load an instance reports (registry heartbeats and GET /load), with its LoRA
    adapters' residency when `adapters` is given (`LoraTable.residency`)."""

    def load() -> InstanceLoad:
        stats = async_engine.stats()
        return InstanceLoad(num_running=stats.num_running, num_waiting=stats.num_waiting,
                            kv_usage=stats.kv_usage, num_in_flight=async_engine.num_in_flight,
                            adapters=adapters() if adapters is not None else ())

    return load


def with_adapters(load_fn: LoadFn,
                  adapters: Callable[[], tuple[AdapterResidency, ...]]) -> LoadFn:
    """`load_fn`'s load with the instance's LoRA adapters' residency added (none: unchanged)."""

    def load() -> InstanceLoad:
        report = load_fn()
        residency = adapters()
        return dataclasses.replace(report, adapters=residency) if residency else report

    return load


def http_ready_probe(base_url: str, *, timeout_s: float = 1.0) -> ReadyFn:
    """True once GET {base_url}/ready answers 200: the instance is reachable where it says."""

    async def probe() -> bool:
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                return (await client.get(f"{base_url.rstrip('/')}/ready")).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


class Registration:
    """Keeps one instance record alive in a registry (see the module docstring)."""

    def __init__(self, registry: Registry, record: InstanceRecord, *, interval_s: float = 1.0,
                 load_fn: LoadFn, ready_fn: ReadyFn | None = None,
                 owns_registry: bool = False, call_timeout_s: float = 5.0) -> None:
        self.registry = registry
        self.record = record.with_state(InstanceState.STARTING)
        self.interval_s = interval_s
        self.load_fn = load_fn
        self.ready_fn = ready_fn
        self.owns_registry = owns_registry  # close the registry on stop()
        self.call_timeout_s = call_timeout_s
        self.state = InstanceState.STARTING
        self.is_registered = False
        self._num_unready_probes = 0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def instance_id(self) -> str:
        return self.record.instance_id

    def start(self) -> None:
        """Run the register/heartbeat loop as a task of the running event loop."""
        if self._task is None and not self._stopped:
            self._task = asyncio.create_task(self._run(), name=f"registration-{self.instance_id}")

    async def drain(self) -> None:
        """Report DRAINING at once (and in every later heartbeat)."""
        self.state = InstanceState.DRAINING
        await self._beat()

    async def stop(self) -> None:
        """End the heartbeats and deregister (idempotent; errors are logged, not raised)."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._quietly("deregister", self.registry.deregister(self.instance_id))
        self.is_registered = False
        if self.owns_registry:
            await self._quietly("close", self.registry.close())

    # --- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopped:  # also ends the loop if a cancellation was swallowed
            if self.state is InstanceState.STARTING and await self._is_ready():
                self.state = InstanceState.READY
            await self._beat()
            await asyncio.sleep(self.interval_s)

    async def _is_ready(self) -> bool:
        if self.ready_fn is None or await self.ready_fn():
            return True
        self._num_unready_probes += 1
        if self._num_unready_probes == 10:
            log.warning("instance %s does not answer at %s/ready yet; routers will not use it "
                        "until it does (check --advertise-url)", self.instance_id, self.record.url)
        return False

    async def _beat(self) -> None:
        """One heartbeat; registers (again) when the registry does not know this instance."""
        if self._stopped:
            return
        load = self.load_fn()
        if self.is_registered:
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    await self.registry.heartbeat(self.instance_id, state=self.state, load=load)
                return
            except RegistryError as exc:
                log.warning("heartbeat of %s failed (%s); registering again", self.instance_id, exc)
            except Exception as exc:  # a registry outage must not stop serving
                log.warning("heartbeat of %s failed: %r; retrying", self.instance_id, exc)
                return
        record = InstanceRecord.from_json({**self.record.to_json(), "state": self.state.value,
                                           "load": load.to_json()})
        self.is_registered = await self._quietly("register", self.registry.register(record))

    async def _quietly(self, what: str, call: Awaitable[None]) -> bool:
        try:
            async with asyncio.timeout(self.call_timeout_s):  # wait_for may swallow a cancel
                await call
            return True
        except Exception as exc:  # logged and retried, never fatal
            log.warning("registry %s of %s failed: %r", what, self.instance_id, exc)
            return False


def build_registration(registry_url: str, *, instance_id: str, advertise_url: str, model: str,
                       async_engine: AsyncEngine, version: str = "default",
                       role: Role | str = Role.MIXED, pool: str = "default",
                       simulated: bool = False, interval_s: float = 1.0, ttl_s: float = 5.0,
                       clock: Clock = time.time, layout: str = "tp1",
                       ranks: tuple[RankInfo, ...] = (), node: str = "",
                       deterministic: bool = False) -> Registration:
    """The Registration `strata serve --registry URL ...` runs (ConfigError on a bad URL).
    A parallel instance registers once, with its `layout` and its `ranks`; `node` names the
    machine (`strata status` shows it); `deterministic` is its `ServerConfig.deterministic`
    (the gateway's GET /v1/models reports it per model)."""
    if role not in tuple(Role):
        raise ConfigError(f"unknown role {role!r}; use one of: {', '.join(Role)}")
    record = InstanceRecord(instance_id=instance_id, url=advertise_url.rstrip("/"), model=model,
                            version=version, role=Role(role), pool=pool, simulated=simulated,
                            layout=layout, ranks=ranks, node=node, deterministic=deterministic)
    registry = create_registry(registry_url, ttl_s=ttl_s, clock=clock)
    return Registration(registry, record, interval_s=interval_s,
                        load_fn=engine_load(async_engine),
                        ready_fn=http_ready_probe(record.url), owns_registry=True)


__all__ = ["Registration", "build_registration", "engine_load", "http_ready_probe",
           "with_adapters"]
