"""The instance's LoRA adapters by name: which it knows, which are resident, who holds them.

An adapter is known by name and path (--lora-modules, POST /v1/load_lora_adapter) and resident
when the engine holds its weights: `ServerConfig.loras` (name -> content digest) is the resident
set, which requests read to pick their adapter; `ServerConfig.lora_paths` (name -> path) is every
adapter known. Without --max-cpu-loras every known adapter is resident (nothing is evicted).
With it, at most `max_resident` are, and:

    lease     a request naming an adapter holds it from the one door (preamble.py) until its
              answer's last byte is sent (`LeaseRelease`); a held adapter is never evicted
    load      a request for a known adapter that is not resident loads it on demand: the files
              are read and checked off the event loop (as at start: strata.model.lora), the
              adapter joins the engine between two steps, and its name maps to the digest of
              the files read now (files changed since start give a new digest, so the prefix
              cache never mixes the two)
    evict     to make room, the least recently used resident adapter that nobody holds is
              retired (strata/engine/loras.py frees its weights once the engine has no request
              on it); when every resident adapter is held, the load waits its turn until one is
              let go, bounded by the request's deadline and its client staying (cancel.py).
              With at least one slot that wait always ends: each request holds one adapter.

`residency()` is what the instance publishes of its adapters in its load report (registry
heartbeats and GET /load; strata/protocol/lora.py), for the gateway's adapter placement.

Loads run one at a time, in arrival order (`_lock`); while one waits, requests for resident
adapters queue behind it too, so that a popular adapter's stream of requests cannot keep its
lease count above zero for ever and starve the load. Only the event loop calls these.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from strata.errors import InvalidRequestError, LoraError, ModelNotFoundError
from strata.protocol.lora import AdapterResidency
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.metrics import LoraMetrics

# (name, path) -> a strata.model.lora.LoraAdapter checked against the base; raises LoraError
LoraLoader = Callable[[str, str], Any]
LEASE_STATE = "strata_lora_lease"  # ASGI scope["state"] key: the name a request holds


class LoraTable:
    """The instance's adapters by name (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, loader: LoraLoader | None,
                 metrics: LoraMetrics | None = None,
                 sizes: Mapping[str, int] | None = None) -> None:
        self.engine = engine
        self.config = config
        self.loader = loader
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self._num_leases: dict[str, int] = {}
        self._recent: OrderedDict[str, None] = OrderedDict((n, None) for n in config.loras)
        self._bytes: dict[str, int] = dict(sizes or {})  # by digest
        self._freed = asyncio.Event()  # set when a lease ends (a waiting load looks again)
        self._num_loads: dict[str, int] = {}  # by name, since start
        self._num_evictions: dict[str, int] = {}
        self._load_s: dict[str, float] = {}  # the last load's time
        self._observe()

    @property
    def max_resident(self) -> int | None:
        return self.config.max_cpu_loras

    def is_known(self, name: str) -> bool:
        return name in self.config.loras or name in self.config.lora_paths

    def num_leases(self, name: str) -> int:
        return self._num_leases.get(name, 0)

    def residency(self) -> tuple[AdapterResidency, ...]:
        """Every adapter known, by name: its resident digest (None when it is not), its loads
        and evictions since start and its last load's time."""
        names = sorted({*self.config.loras, *self.config.lora_paths})
        return tuple(AdapterResidency(name, self.config.loras.get(name),
                                      self._num_loads.get(name, 0),
                                      self._num_evictions.get(name, 0),
                                      self._load_s.get(name, 0.0)) for name in names)

    # requests

    async def acquire(self, name: str) -> None:
        """Hold `name` resident until `release(name)`; loads it first when it is not."""
        if name in self.config.loras and (self.max_resident is None or not self._lock.locked()):
            self._lease(name)  # without a limit nothing is evicted: no need to queue
            return
        async with self._lock:
            if name not in self.config.loras:
                path = self.config.lora_paths.get(name)
                if path is None:
                    raise ModelNotFoundError(f"The model `{name}` does not exist", param="model")
                await self._make_room(keep=name)
                await asyncio.shield(self._load(name, path))
            self._lease(name)

    def release(self, name: str) -> None:
        left = self._num_leases.get(name, 0) - 1
        if left > 0:
            self._num_leases[name] = left
        else:
            self._num_leases.pop(name, None)
            self._freed.set()

    def _lease(self, name: str) -> None:
        self._num_leases[name] = self._num_leases.get(name, 0) + 1
        self._touch(name)

    def _touch(self, name: str) -> None:
        """`name` is now the most recently used."""
        self._recent[name] = None
        self._recent.move_to_end(name)

    # the admin routes

    async def load(self, name: str, path: str, sha256: str | None = None) -> bool:
        """Serve the adapter at `path` as `name`; False when it already did (same digest).
        With `sha256` (a registered adapter version's), files with another digest are refused
        before the engine sees them: the name never serves other weights than registered."""
        if name == self.config.served_model_name:
            raise InvalidRequestError(f"lora_name {name!r} is the base model's name",
                                      param="lora_name")
        if self.loader is None:
            raise InvalidRequestError("this instance cannot load LoRA adapters (a simulated "
                                      "or embedding instance)", param="lora_path")
        async with self._lock:
            if name not in self.config.loras:
                await self._make_room(keep=name)
            old = self.config.loras.get(name)
            try:
                digest = await asyncio.shield(self._load(name, path, sha256))
            except LoraError as exc:
                raise InvalidRequestError(str(exc), param="lora_path") from exc
            self.config.lora_paths[name] = path
            if old is not None and old != digest:
                await self._retire(old)
        return old != digest

    async def unload(self, name: str) -> None:
        async with self._lock:
            path = self.config.lora_paths.pop(name, None)
            digest = self.config.loras.pop(name, None)
            self._recent.pop(name, None)
            if digest is None and path is None:
                raise ModelNotFoundError(f"The LoRA adapter `{name}` is not loaded",
                                         param="lora_name")
            if digest is not None:
                await self._retire(digest)
            self._observe()

    # residency

    async def _load(self, name: str, path: str, sha256: str | None = None) -> str:
        """Read, check, add, map; the digest. Shielded: once begun it ends mapped, so the engine
        never holds weights that no name (and no eviction) reaches."""
        assert self.loader is not None
        began = time.perf_counter()
        adapter = await asyncio.to_thread(self.loader, name, path)
        if sha256 is not None and adapter.digest != sha256:
            raise LoraError(f"the adapter files at {path} have sha256 {adapter.digest}, not "
                            f"{sha256} (the registered version's): other files were put there")
        await self.engine.add_lora(adapter)
        self.config.loras[name] = adapter.digest
        self._bytes[adapter.digest] = int(getattr(adapter, "num_bytes", 0))
        self._touch(name)
        load_s = time.perf_counter() - began
        self._num_loads[name] = self._num_loads.get(name, 0) + 1
        self._load_s[name] = load_s
        if self.metrics is not None:
            self.metrics.loads.labels(self.config.served_model_name).inc()
            self.metrics.load_s.labels(self.config.served_model_name).observe(load_s)
        self._observe()
        return str(adapter.digest)

    async def _make_room(self, keep: str) -> None:
        """Evict until one more adapter fits, waiting while every resident one is held."""
        limit = self.max_resident
        while limit is not None and len(self.config.loras) >= limit:
            victim = self._victim(keep)
            if victim is None:
                self._freed.clear()
                await self._freed.wait()
                continue
            digest = self.config.loras.pop(victim)
            self._recent.pop(victim, None)
            self._num_evictions[victim] = self._num_evictions.get(victim, 0) + 1
            await self._retire(digest)
            if self.metrics is not None:
                self.metrics.evictions.labels(self.config.served_model_name).inc()
            self._observe()

    def _victim(self, keep: str) -> str | None:
        """The least recently used resident adapter nobody holds that can be loaded back."""
        for name in self._recent:
            if name != keep and name in self.config.loras and not self._num_leases.get(name) \
                    and name in self.config.lora_paths:
                return name
        return None

    async def _retire(self, digest: str) -> None:
        if digest not in self.config.loras.values():  # another name may serve the same files
            self._bytes.pop(digest, None)
            await self.engine.retire_lora(digest)

    def _observe(self) -> None:
        if self.metrics is None:
            return
        model = self.config.served_model_name
        digests = set(self.config.loras.values())
        self.metrics.resident.labels(model).set(len(digests))
        self.metrics.resident_bytes.labels(model).set(sum(self._bytes.get(d, 0) for d in digests))


class LeaseRelease:
    """ASGI middleware: a request's adapter lease (taken at the one door) ends when the app has
    sent its answer, a stream's last frame included, or failed."""

    def __init__(self, app: ASGIApp, table: Callable[[], LoraTable]) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            name = scope.get("state", {}).pop(LEASE_STATE, None) if scope["type"] == "http" \
                else None
            if name is not None:
                self.table().release(name)


async def hold_adapter(scope: Scope, table: LoraTable, name: str | None) -> None:
    """The one door's step: a request naming a known adapter holds it (loaded if need be)."""
    if name is None or not table.is_known(name) or LEASE_STATE in scope.get("state", {}):
        return
    await table.acquire(name)
    scope.setdefault("state", {})[LEASE_STATE] = name


__all__ = ["LEASE_STATE", "LeaseRelease", "LoraLoader", "LoraTable", "hold_adapter"]
