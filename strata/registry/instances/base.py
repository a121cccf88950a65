"""The instance registry's contract, shared by every backend.

    Registry (Protocol)          async; memory, sqlite and redis implement it
    RegistryError(StrataError)   an unknown instance id, or a backend that cannot be reached

Contract (tests/registry/test_contract.py checks it on every backend):
- `register` upserts the record and stamps `last_heartbeat = clock()`.
- `heartbeat` stamps `last_heartbeat = clock()` and replaces state and/or load when given; an
  unknown id raises RegistryError (the caller registers again).
- `deregister` is idempotent.
- `get` and `list_instances` report a record whose heartbeat is older than `ttl_s` with state DEAD;
  the stored state is unchanged, so the next heartbeat brings it back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from strata.clock import Clock
from strata.errors import ConfigError, RegistryError
from strata.registry.instances.records import InstanceLoad, InstanceRecord, InstanceState


@dataclass(frozen=True, slots=True)
class RegistryOptions:
    """What `create_registry` hands every backend's `from_url`: records expire `ttl_s` after a
    heartbeat, by `clock`."""

    ttl_s: float = 5.0
    clock: Clock = time.time


@runtime_checkable
class Registry(Protocol):
    """Where instances announce themselves and routers find them."""

    async def register(self, record: InstanceRecord) -> None:
        """Insert or replace `record`; its last_heartbeat becomes the registry's clock()."""
        ...

    async def heartbeat(self, instance_id: str, *, state: InstanceState | None = None,
                        load: InstanceLoad | None = None) -> None:
        """Refresh `instance_id` (and its state / load); RegistryError if it is unknown."""
        ...

    async def deregister(self, instance_id: str) -> None:
        """Remove `instance_id`; removing an unknown id does nothing."""
        ...

    async def get(self, instance_id: str) -> InstanceRecord | None:
        """The record (DEAD when its heartbeat expired), or None."""
        ...

    async def list_instances(self) -> list[InstanceRecord]:
        """Every record, sorted by instance id, expired ones with state DEAD."""
        ...

    async def close(self) -> None:
        """Release connections; the registry is unusable afterwards."""
        ...


def as_seen(record: InstanceRecord, now: float, ttl_s: float) -> InstanceRecord:
    """`record` as a reader sees it at `now`: DEAD once its heartbeat is older than `ttl_s`."""
    if now - record.last_heartbeat > ttl_s and record.state is not InstanceState.DEAD:
        return replace(record, state=InstanceState.DEAD)
    return record


def unknown_instance(instance_id: str) -> RegistryError:
    return RegistryError(f"instance {instance_id!r} is not registered; register it first "
                         f"(it may have been deregistered or the registry was reset)")


def check_ttl(ttl_s: float) -> None:
    if ttl_s <= 0:
        raise ConfigError(f"registry ttl_s must be positive, got {ttl_s}")


__all__ = ["Registry", "RegistryError", "RegistryOptions", "as_seen", "check_ttl",
           "unknown_instance"]
