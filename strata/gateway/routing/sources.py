"""Where the instance set comes from: a registry (polled) or static URLs (learned over HTTP).

A source has one method, `refresh()`, which brings the `InstanceSet` up to date; the app calls it
every `poll_interval_s`. A failed refresh leaves the set as it was (the health checker judges
instances that stopped answering).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from strata.clock import Clock
from strata.gateway.routing.instances import (
    DRAINING,
    READY,
    STARTING,
    InstanceSet,
    InstanceView,
    RecordLike,
    ReportedLoad,
    adapters_by_name,
)
from strata.protocol.lora import residency_of

logger = logging.getLogger("strata.gateway")


class InstanceSource(Protocol):
    """Keeps an `InstanceSet` current."""

    instances: InstanceSet

    async def refresh(self) -> None: ...


class RegistryLike(Protocol):
    """The one `strata.registry.Registry` method the gateway needs."""

    async def list_instances(self) -> Sequence[RecordLike]: ...


class RegistrySource:
    """Mirrors `registry.list_instances()` (records past their TTL come back as `dead`).

    While the registry cannot be read, the set stays as it was. For `outage_grace_s` after it
    can be read again, a ready instance that passes its health checks stays ready even if its
    record is `dead` (its heartbeats were lost in the outage and resume within a few seconds;
    `InstanceSet.apply_records`)."""

    def __init__(self, registry: RegistryLike, instances: InstanceSet | None = None, *,
                 outage_grace_s: float = 10.0,
                 clock: Clock = time.monotonic) -> None:
        self.registry = registry
        self.instances = instances if instances is not None else InstanceSet()
        self.outage_grace_s = outage_grace_s
        self.clock = clock
        self.is_failing = False
        self.recovered_at = -math.inf

    async def refresh(self) -> None:
        try:
            records = await self.registry.list_instances()
        except Exception as exc:  # a registry hiccup must not stop routing on the last view
            logger.warning("registry refresh failed: %s", exc)
            self.is_failing = True
            return
        now = self.clock()
        if self.is_failing:
            self.is_failing, self.recovered_at = False, now
            logger.info("registry readable again; stale heartbeats are forgiven for %.0fs",
                        self.outage_grace_s)
        is_after_outage = now - self.recovered_at < self.outage_grace_s
        self.instances.apply_records(records, is_after_outage=is_after_outage)


def instance_id_for(url: str) -> str:
    """A static instance's id: its host:port."""
    parts = urlsplit(url)
    return parts.netloc or url


class StaticSource:
    """Instances given by URL. Each one's model and `deterministic` come from its GET /v1/models
    (it is `starting` until that answers) and its load and draining flag from GET /load."""

    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient,
                 instances: InstanceSet | None = None) -> None:
        self.client = client
        self.instances = instances if instances is not None else InstanceSet()
        for url in urls:
            base = url.rstrip("/")
            self.instances.add(InstanceView(instance_id_for(base), base, "", state=STARTING))

    async def refresh(self) -> None:
        await asyncio.gather(*(self._refresh_one(v) for v in self.instances.snapshot()))

    async def _refresh_one(self, view: InstanceView) -> None:
        try:
            if not view.model:
                await self._learn_model(view)
                view.state = READY
            await self._learn_load(view)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            logger.debug("refresh of %s failed: %s", view.url, exc)

    async def _learn_model(self, view: InstanceView) -> None:
        """Its model and whether it is deterministic, from the first card of its /v1/models."""
        response = await self.client.get(f"{view.url}/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
        view.model = card["id"]
        view.deterministic = card.get("deterministic") is True

    async def _learn_load(self, view: InstanceView) -> None:
        response = await self.client.get(f"{view.url}/load")
        if response.status_code == 404:  # an instance without /load: no reported load
            return
        response.raise_for_status()
        data = response.json()
        view.reported = ReportedLoad(int(data.get("num_running", 0)),
                                     int(data.get("num_waiting", 0)),
                                     float(data.get("kv_usage", 0.0)),
                                     adapters_by_name(residency_of(data.get("adapters"))))
        view.state = DRAINING if data.get("draining") else READY


__all__ = ["InstanceSource", "RegistryLike", "RegistrySource", "StaticSource", "instance_id_for"]
