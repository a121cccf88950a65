"""Leases: one holder at a time for a named job (the autoscaler's leader), kept in the registry.

    Lease        name -> holder and `until` (a time on the holders' clock), with a revision
    LeaseStore   get_lease / put_lease (compare-and-set on revision, 0 = create); the memory,
                 SQLite and Redis model registries implement it (tests/registry/test_leases.py)
    hold(...)    take the lease or renew it; None while another holder's lease is live

A holder renews well before `until`; one that stops renewing loses the lease when it expires,
and the next caller of `hold` takes it. Two callers racing for it write the same revision: one
wins the compare-and-set, the other is told who holds it. So two holders never overlap, as long
as their clocks agree to within the renewal margin (`renew_before_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from strata.errors import ConfigError, ConflictError


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    holder: str = ""
    until: float = 0.0
    revision: int = 0
    updated_at: float = 0.0

    def is_held_by_other(self, holder: str, now: float) -> bool:
        return bool(self.holder) and self.holder != holder and self.until > now

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "holder": self.holder, "until": self.until,
                "revision": self.revision, "updated_at": self.updated_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lease:
        return cls(name=str(data["name"]), holder=str(data.get("holder", "")),
                   until=float(data.get("until", 0.0)), revision=int(data.get("revision", 0)),
                   updated_at=float(data.get("updated_at", 0.0)))


@runtime_checkable
class LeaseStore(Protocol):
    async def get_lease(self, name: str) -> Lease | None: ...

    async def put_lease(self, lease: Lease, *, expected_revision: int) -> Lease:
        """Compare-and-set (0 = create); the stored record, or ConflictError."""
        ...


async def hold(store: LeaseStore, name: str, holder: str, *, lease_s: float,
               now: float) -> Lease | None:
    """Take or renew `name` for `holder` until `now + lease_s`; None while another holds it."""
    if not holder or lease_s <= 0:
        raise ConfigError("a lease needs a holder name and a positive lease_s")
    current = await store.get_lease(name)
    if current is not None and current.is_held_by_other(holder, now):
        return None
    wanted = replace(current or Lease(name), holder=holder, until=now + lease_s)
    try:
        return await store.put_lease(wanted, expected_revision=wanted.revision)
    except ConflictError:  # another caller wrote it since we read it
        return None


async def release(store: LeaseStore, name: str, holder: str) -> None:
    """Give the lease up at once (a clean stop), if `holder` still holds it."""
    current = await store.get_lease(name)
    if current is not None and current.holder == holder:
        try:
            await store.put_lease(replace(current, holder="", until=0.0),
                                  expected_revision=current.revision)
        except ConflictError:
            pass


__all__ = ["Lease", "LeaseStore", "hold", "release"]
