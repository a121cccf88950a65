"""The Redis registry: many machines. One hash per instance plus a set of instance ids.

    {prefix}:ids            SET of instance ids
    {prefix}:instance:{id}  HASH record (JSON of the whole record at register time),
                            state, load (JSON), last_heartbeat (float, on the registry's clock)

A heartbeat is one Lua script (exists? then HSET), so it is atomic and cannot resurrect an
instance that was deregistered meanwhile. Expiry is computed by readers from last_heartbeat with
the injected clock (no Redis key TTLs), exactly as the other backends do.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from strata.clock import Clock
from strata.errors import RegistryError
from strata.registry.instances.base import RegistryOptions, as_seen, check_ttl, unknown_instance
from strata.registry.instances.records import InstanceLoad, InstanceRecord, InstanceState
from strata.state.redis_db import RedisDatabase

_HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class RedisRegistry:
    """A Registry in a Redis server shared by every process that uses the same URL and prefix."""

    def __init__(self, url: str, *, ttl_s: float = 5.0, clock: Clock = time.time,
                 prefix: str = "strata:registry") -> None:
        check_ttl(ttl_s)
        self.url = url
        self.ttl_s = ttl_s
        self.clock = clock
        self.prefix = prefix
        self._db = RedisDatabase(url, error=RegistryError, what="redis registry",
                                 decode_responses=True)
        self._client: Any = self._db.client
        self._heartbeat: Any = self._db.script(_HEARTBEAT)

    # --- Registry -----------------------------------------------------------------------------

    async def register(self, record: InstanceRecord) -> None:
        stamped = replace(record, last_heartbeat=self.clock())
        fields = {"record": json.dumps(stamped.to_json()), "state": stamped.state.value,
                  "load": json.dumps(stamped.load.to_json()),
                  "last_heartbeat": repr(stamped.last_heartbeat)}
        key = self._key(record.instance_id)

        async def write() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(key).hset(key, mapping=fields).sadd(self._ids, record.instance_id)
                await pipe.execute()

        await self._db.call(write)

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        args = ["last_heartbeat", repr(float(self.clock()))]
        if state is not None:
            args += ["state", state.value]
        if load is not None:
            args += ["load", json.dumps(load.to_json())]
        key = self._key(instance_id)
        found = await self._db.call(lambda: self._heartbeat(keys=[key], args=args))
        if not found:
            raise unknown_instance(instance_id)

    async def deregister(self, instance_id: str) -> None:
        async def write() -> None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(self._key(instance_id)).srem(self._ids, instance_id)
                await pipe.execute()

        await self._db.call(write)

    async def get(self, instance_id: str) -> InstanceRecord | None:
        fields = await self._db.call(lambda: self._client.hgetall(self._key(instance_id)))
        return self._decode(fields, self.clock()) if fields else None

    async def list_instances(self) -> list[InstanceRecord]:
        ids = sorted(await self._db.call(lambda: self._client.smembers(self._ids)))

        async def read() -> list[dict[str, str]]:
            async with self._client.pipeline(transaction=False) as pipe:
                for instance_id in ids:
                    pipe.hgetall(self._key(instance_id))
                result: list[dict[str, str]] = await pipe.execute()
                return result

        now = self.clock()
        # an id whose hash is gone was deregistered between the two reads
        return [self._decode(f, now) for f in await self._db.call(read) if f]

    async def close(self) -> None:
        await self._db.aclose()

    # --- internals ----------------------------------------------------------------------------

    @property
    def _ids(self) -> str:
        return f"{self.prefix}:ids"

    def _key(self, instance_id: str) -> str:
        return f"{self.prefix}:instance:{instance_id}"

    def _decode(self, fields: dict[str, str], now: float) -> InstanceRecord:
        data = json.loads(fields["record"])
        data.update(state=fields["state"], load=json.loads(fields["load"]),
                    last_heartbeat=float(fields["last_heartbeat"]))
        return as_seen(InstanceRecord.from_json(data), now, self.ttl_s)



def from_url(url: str, options: RegistryOptions) -> RedisRegistry:
    return RedisRegistry(url, ttl_s=options.ttl_s, clock=options.clock)


__all__ = ["RedisRegistry", "from_url"]
