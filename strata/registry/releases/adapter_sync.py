"""Instances that start after an adapter was released load it: `AdapterSync`.

A release loads an adapter version on the base's instances that are up at the time
(adapter_steps.py). An instance started later (scale-out, a restart, a new base version's
instance once it is live) knows none of them, so every `interval` each gateway compares, for
every adapter with a routing record, the versions that take traffic (live, and the canary) with
what each READY instance of the base's live version lists in its heartbeat, and loads what is
missing through the same `AdapterFleet`. A load of files already served changes nothing, so two
gateways doing it at once is harmless; an instance that refused (or did not list it yet) is
asked again only after `retry_s`. Versions no longer live are not unloaded here: a release
unloads what it retires.
"""

from __future__ import annotations

import logging
import time

from strata.clock import Clock
from strata.registry.instances.base import Registry
from strata.registry.models.base import ModelRegistry, ModelVersion
from strata.registry.releases.adapter_steps import AdapterFleet, adapter_path, base_targets, lists

logger = logging.getLogger("strata.registry.releases.adapter_sync")


class AdapterSync:
    """Loads the serving adapter versions where they are missing (see the module)."""

    def __init__(self, models: ModelRegistry, instances: Registry, fleet: AdapterFleet, *,
                 retry_s: float = 5.0, clock: Clock = time.monotonic) -> None:
        self.models, self.instances, self.fleet = models, instances, fleet
        self.retry_s, self.clock = retry_s, clock
        self._asked: dict[tuple[str, str], float] = {}  # (instance_id, name@version) -> when

    async def sync_once(self) -> int:
        """One pass; how many loads it asked for."""
        num_asked = 0
        for version in await self._serving():
            for record in await base_targets(self.models, self.instances, version.base):
                if lists(record, version.key) or not self._may_ask(record.instance_id,
                                                                    version.key):
                    continue
                num_asked += 1
                try:
                    await self.fleet.load(record, version.key, adapter_path(version.uri),
                                          version.manifest_sha256)
                    logger.info("loaded %s on %s (it lacked it)", version.key,
                                record.instance_id)
                except Exception as exc:  # logged; asked again after retry_s
                    logger.warning("loading %s on %s failed: %s", version.key,
                                   record.instance_id, exc)
        return num_asked

    async def _serving(self) -> list[ModelVersion]:
        """The adapter versions that take traffic: each adapter's live one and its canary."""
        adapters = {v.key: v for v in await self.models.list_versions() if v.is_adapter}
        if not adapters:
            return []
        found = []
        for routing in await self.models.list_routing():
            for version in (routing.live, routing.canary):
                record = adapters.get(f"{routing.name}@{version}")
                if record is not None:
                    found.append(record)
        return found

    def _may_ask(self, instance_id: str, key: str) -> bool:
        now = self.clock()
        last = self._asked.get((instance_id, key))
        if last is not None and now - last < self.retry_s:
            return False
        self._asked[(instance_id, key)] = now
        return True


__all__ = ["AdapterSync"]
