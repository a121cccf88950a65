"""Leases in the registry (strata/registry/leases.py) on every backend: memory, SQLite, a real
Redis. One holder at a time; an expired lease passes on; racing takers, exactly one wins."""

from __future__ import annotations

import asyncio
from typing import Any

from model_registries import (
    Make,
    make_fixture,  # noqa: F401  (the `make` fixture)
    story,
)
from redis_server import redis_server, redis_url  # noqa: F401

from strata.clock import ManualClock
from strata.registry import leases
from strata.registry.leases import Lease


def test_one_holder_at_a_time_and_an_expired_lease_passes_on(make: Make) -> None:
    async def body(reg: Any, clock: ManualClock) -> None:
        a = await leases.hold(reg, "autoscaler", "gw-a", lease_s=5.0, now=100.0)
        assert a is not None and (a.holder, a.until, a.revision) == ("gw-a", 105.0, 1)
        assert await leases.hold(reg, "autoscaler", "gw-b", lease_s=5.0, now=104.9) is None
        renewed = await leases.hold(reg, "autoscaler", "gw-a", lease_s=5.0, now=103.0)
        assert renewed is not None and (renewed.until, renewed.revision) == (108.0, 2)
        assert await leases.hold(reg, "autoscaler", "gw-b", lease_s=5.0, now=107.9) is None
        taken = await leases.hold(reg, "autoscaler", "gw-b", lease_s=5.0, now=108.0)
        assert taken is not None and taken.holder == "gw-b"
        assert await leases.hold(reg, "other", "gw-a", lease_s=5.0, now=108.0) is not None
        await leases.release(reg, "autoscaler", "gw-a")  # not its lease any more: no effect
        assert (await reg.get_lease("autoscaler")).holder == "gw-b"
        await leases.release(reg, "autoscaler", "gw-b")
        assert await leases.hold(reg, "autoscaler", "gw-a", lease_s=5.0, now=108.5) is not None

    story(make, body)


def test_racing_takers_exactly_one_wins(make: Make) -> None:
    async def body(reg: Any, clock: ManualClock) -> None:
        others = [make(clock) for _ in range(7)]
        try:
            got = await asyncio.gather(*(
                leases.hold(r, "autoscaler", f"gw-{n}", lease_s=5.0, now=10.0)
                for n, r in enumerate([reg, *others])))
        finally:
            await asyncio.gather(*(r.close() for r in others if r is not reg))
        winners = [g for g in got if g is not None]
        assert len(winners) == 1
        assert await reg.get_lease("autoscaler") == winners[0]

    story(make, body)


def test_a_lease_round_trips_through_json() -> None:
    lease = Lease("autoscaler", "gw-a:8000", 12.5, 3, 7.25)
    assert Lease.from_json(lease.to_json()) == lease
