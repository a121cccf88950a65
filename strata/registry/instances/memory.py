"""The in-process registry: one dict, for tests and single-process setups."""

from __future__ import annotations

import time
from dataclasses import replace

from strata.clock import Clock
from strata.registry.instances.base import RegistryOptions, as_seen, check_ttl, unknown_instance
from strata.registry.instances.records import InstanceLoad, InstanceRecord, InstanceState


class MemoryRegistry:
    """A Registry held in this process's memory; nothing is shared with other processes."""

    def __init__(self, *, ttl_s: float = 5.0, clock: Clock = time.time) -> None:
        check_ttl(ttl_s)
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: dict[str, InstanceRecord] = {}

    async def register(self, record: InstanceRecord) -> None:
        self._records[record.instance_id] = replace(record, last_heartbeat=self.clock())

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        record = self._records.get(instance_id)
        if record is None:
            raise unknown_instance(instance_id)
        self._records[instance_id] = replace(
            record, state=state or record.state, load=load or record.load,
            last_heartbeat=self.clock())

    async def deregister(self, instance_id: str) -> None:
        self._records.pop(instance_id, None)

    async def get(self, instance_id: str) -> InstanceRecord | None:
        record = self._records.get(instance_id)
        return None if record is None else as_seen(record, self.clock(), self.ttl_s)

    async def list_instances(self) -> list[InstanceRecord]:
        now = self.clock()
        return [as_seen(self._records[k], now, self.ttl_s) for k in sorted(self._records)]

    async def close(self) -> None:
        return None



def from_url(url: str, options: RegistryOptions) -> MemoryRegistry:
    return MemoryRegistry(ttl_s=options.ttl_s, clock=options.clock)


__all__ = ["MemoryRegistry", "from_url"]
