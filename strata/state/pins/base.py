"""The session pin table: which instance a session sticks to, shared by every gateway.

Contract (one test suite runs it over all three backends):
- `set_if(session, instance, expected=e)` is a compare-and-set: it writes only when the current
  pin equals `e` (None = no live pin), atomically across processes; of racing writers exactly one
  wins. Writing the pin it already has (e == instance) refreshes its expiry.
- A pin expires `ttl_s` after it was last written or read (`get` slides the expiry), so idle
  sessions unpin; expiry is judged on the store's injected clock (wall time by default, shared by
  every process), never on Redis key TTLs alone.
- `counts()` is the number of live pins per instance (the bounded-load input of every gateway).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from strata.clock import Clock
from strata.errors import ConfigError, PinStoreError


class PinStore(Protocol):
    """Session id -> instance id, with compare-and-set writes and sliding expiry."""

    async def get(self, session_id: str) -> str | None:
        """The live pin of `session_id` (and its expiry slides), or None."""
        ...

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        """Pin `session_id` to `instance_id` if its live pin is `expected`; True if written."""
        ...

    async def delete(self, session_id: str) -> None:
        """Unpin `session_id` (no error when it had no pin)."""
        ...

    async def counts(self) -> dict[str, int]:
        """Live pins per instance id (instances with none are absent)."""
        ...

    async def close(self) -> None:
        ...


def check_namespace(namespace: str) -> str:
    """`namespace`, if it can name a table and a key prefix (a plain identifier)."""
    if not namespace.isidentifier() or not namespace.isascii():
        raise ConfigError(f"pin store namespace must be a plain identifier, got {namespace!r}")
    return namespace


@dataclass(frozen=True, slots=True)
class PinStoreOptions:
    """What `create_pin_store` hands every backend's `from_url`. Pins expire `ttl_s` after
    their last use; `namespace` separates tables of pins in one store: "pins" (session ->
    instance, the sticky routing table) and "versions" (session -> model version) share a
    backend, not their keys."""

    ttl_s: float = 3600.0
    clock: Clock = time.time
    namespace: str = "pins"

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ConfigError(f"pin ttl_s must be positive, got {self.ttl_s}")
        check_namespace(self.namespace)


__all__ = ["PinStore", "PinStoreError", "PinStoreOptions", "check_namespace"]
