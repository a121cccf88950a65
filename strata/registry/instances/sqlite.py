"""The SQLite registry: one file, many processes on one machine (the default of `strata up`).

One table, one JSON document per instance. Every operation is one short statement in its own
transaction (heartbeat is a single `UPDATE ... json_set`, so concurrent writers never lose a
field); WAL lets readers run beside the writer and `busy_timeout` makes writers wait for the lock
instead of failing. Blocking calls run in a worker thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from strata.clock import Clock
from strata.errors import RegistryError
from strata.registry.instances.base import RegistryOptions, as_seen, check_ttl, unknown_instance
from strata.registry.instances.records import InstanceLoad, InstanceRecord, InstanceState
from strata.state.sqlite_db import SqliteDatabase, sqlite_path

_SCHEMA = ("CREATE TABLE IF NOT EXISTS instances "
           "(instance_id TEXT PRIMARY KEY, record TEXT NOT NULL)")


class SqliteRegistry:
    """A Registry in a SQLite file shared by every process that opens the same path."""

    def __init__(self, path: str | Path, *, ttl_s: float = 5.0,
                 clock: Clock = time.time, busy_timeout_ms: int = 10_000) -> None:
        check_ttl(ttl_s)
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.clock = clock
        self._db = SqliteDatabase(self.path, schema=[_SCHEMA], error=RegistryError,
                                  what="sqlite registry", busy_timeout_ms=busy_timeout_ms)

    # --- Registry -----------------------------------------------------------------------------

    async def register(self, record: InstanceRecord) -> None:
        data = json.dumps(replace(record, last_heartbeat=self.clock()).to_json())
        await self._run("INSERT INTO instances (instance_id, record) VALUES (?, ?) "
                        "ON CONFLICT(instance_id) DO UPDATE SET record = excluded.record",
                        (record.instance_id, data))

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        paths = ["'$.last_heartbeat', ?"]
        params: list[Any] = [self.clock()]
        if state is not None:
            paths.append("'$.state', ?")
            params.append(state.value)
        if load is not None:
            paths.append("'$.load', json(?)")
            params.append(json.dumps(load.to_json()))
        sql = f"UPDATE instances SET record = json_set(record, {', '.join(paths)}) " \
              "WHERE instance_id = ?"
        if await self._run(sql, (*params, instance_id)) == 0:
            raise unknown_instance(instance_id)

    async def deregister(self, instance_id: str) -> None:
        await self._run("DELETE FROM instances WHERE instance_id = ?", (instance_id,))

    async def get(self, instance_id: str) -> InstanceRecord | None:
        rows = await self._select("SELECT record FROM instances WHERE instance_id = ?",
                                  (instance_id,))
        return self._decode(rows[0][0], self.clock()) if rows else None

    async def list_instances(self) -> list[InstanceRecord]:
        rows = await self._select("SELECT record FROM instances ORDER BY instance_id", ())
        now = self.clock()
        return [self._decode(row[0], now) for row in rows]

    async def close(self) -> None:
        await self._db.aclose()

    # --- internals ----------------------------------------------------------------------------

    def _decode(self, text: str, now: float) -> InstanceRecord:
        return as_seen(InstanceRecord.from_json(json.loads(text)), now, self.ttl_s)

    async def _run(self, sql: str, params: tuple[Any, ...]) -> int:
        """Execute one write in its own transaction; the number of rows it changed."""
        return await self._db.call(lambda c: c.execute(sql, params).rowcount)

    async def _select(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return await self._db.call(lambda c: c.execute(sql, params).fetchall())



def from_url(url: str, options: RegistryOptions) -> SqliteRegistry:
    path = sqlite_path(url, what="registry", example="sqlite:///var/run/strata/registry.db")
    return SqliteRegistry(path, ttl_s=options.ttl_s, clock=options.clock)


__all__ = ["SqliteRegistry", "from_url"]
